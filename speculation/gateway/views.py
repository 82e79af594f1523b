"""The OpenAI-compatible views: async, so a streaming response holds no thread.

Each request: read the gateway version (one Redis GET), authenticate (the token's principal, cached per process:
speculation.gateway.auth), find the route (cached table), then hand the call to its mode: off relays bytes,
shadow relays and samples a measurement, prod speculates. `serve` and `list_models` are the gateway itself: the
lean ASGI app (speculation.gateway.asgi, what ace.asgi serves /v1 with) and the Django views below both call them.
"""

from __future__ import annotations

import json
import time

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, HttpResponseBase
from django.views.decorators.csrf import csrf_exempt

from ace import json_body, throttle
from fleet import netpolicy
from fleet.managed.models import NOT_STARTED_URL
from speculation.gateway import capture, passthrough, validation
from speculation.gateway.auth import Principal, authenticate
from speculation.gateway.call import Call, new_request_id
from speculation.gateway.errors import REQUEST_ID_HEADER, error_response
from speculation.gateway.routes import route_cache
from speculation.models import Mode
from speculation.selectors import metrics as stage_metrics
from speculation.workloads import keys as workload_keys

# A managed endpoint's first server is typically serving within a minute of its start.
STARTING_RETRY_S = 10


def _unauthorized(request_id: str) -> HttpResponse:
    return error_response(
        401,
        "A valid ACE API token is required (Authorization: Bearer <token>).",
        code="invalid_api_key",
        request_id=request_id,
        kind="authentication_error",
    )


async def _caller(authorization: str, client: str, *, stamp, request_id: str) -> Principal | HttpResponse:
    """The token's principal, or the answer to send instead: 401 for a bad token, 429 once this client address
    sent ACE_TOKEN_THROTTLE bad tokens within ACE_THROTTLE_WINDOW seconds (ace.throttle), whatever it sends then,
    so that a guess that happens to be right reads like every other."""
    sent_key = len(authorization.split()) > 1  # "Bearer <key>": a request without a key is no guess
    wait = throttle.tokens.wait_s(client) if sent_key else 0
    if wait:
        response = error_response(
            429, throttle.wait_message(wait), code="rate_limit_exceeded", request_id=request_id, kind="rate_limit_error"
        )
        response["Retry-After"] = str(wait)
        return response
    principal = await authenticate(authorization, stamp=stamp)
    if principal is None:
        if sent_key:
            throttle.tokens.failed(client)
        return _unauthorized(request_id)
    return principal


def _body(request: HttpRequest) -> bytes | None:
    """The body, or None when it is over DATA_UPLOAD_MAX_MEMORY_SIZE (Django checks Content-Length; a chunked
    body has none, so its length is checked after reading)."""
    limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    try:
        raw = request.body
    except RequestDataTooBig:
        return None
    return None if limit is not None and len(raw) > limit else raw


async def serve(
    *,
    kind: str,
    method: str,
    authorization: str,
    raw: bytes | None,
    workload_header: str | None = None,
    client: str = "",
    no_capture: str | None = None,
) -> HttpResponseBase:
    """One completion request (`raw`: its body, None when over the size limit; `client`: the caller's address;
    `no_capture`: its capture opt-out header, speculation.gateway.capture), answered in the endpoint's mode."""
    request_id = new_request_id()
    if method != "POST":
        return error_response(405, "Use POST.", code="method_not_allowed", request_id=request_id)
    cache = route_cache()
    stamp = await cache.stamp()
    principal = await _caller(authorization, client, stamp=stamp, request_id=request_id)
    if isinstance(principal, HttpResponse):
        return principal
    if raw is None:
        message = f"The body is larger than {settings.DATA_UPLOAD_MAX_MEMORY_SIZE} bytes (ACE_MAX_BODY_BYTES)."
        return error_response(413, message, code="request_too_large", request_id=request_id)
    try:
        body = json_body.loads(raw)
    except json_body.TooDeep as exc:
        return error_response(400, f"The body is {exc}.", code="invalid_json", request_id=request_id)
    except ValueError:
        return error_response(400, "The body must be JSON.", code="invalid_json", request_id=request_id)
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return error_response(
            400, "The body must be a JSON object naming a model.", code="invalid_request", request_id=request_id
        )
    route = await cache.lookup(body["model"], principal, stamp)
    if route is None:
        # Outside the token's scope reads exactly like an unknown name: other teams' endpoints stay unseen.
        return error_response(
            404,
            f"The model {body['model']!r} does not name a registered endpoint.",
            code="model_not_found",
            request_id=request_id,
        )
    url_problem = netpolicy.shape_problem(route.base_url)
    if url_problem:  # stored unchecked (an older row, SQL by hand): httpx would refuse it and a log line split
        message = f"endpoint {route.name} has a base URL ACE cannot use ({url_problem}); an operator must correct it."
        return error_response(502, message, code="upstream_misconfigured", request_id=request_id)
    if route.base_url == NOT_STARTED_URL:  # a managed endpoint before its first server serves
        message = f"endpoint {route.name}: its managed server is starting (see its page); retry shortly."
        response = error_response(503, message, code="upstream_starting", request_id=request_id)
        response["Retry-After"] = str(STARTING_RETRY_S)
        return response
    if route.mode != Mode.OFF:  # off relays the server's own answer, errors included
        body, invalid = validation.checked(body, kind=kind)
        if invalid is not None:
            return invalid.response(request_id)
        try:  # the key every stage record of this request carries (given, or the prompt's category)
            workload = workload_keys.resolve(header=workload_header, body=body, kind=kind).key
        except workload_keys.BadWorkload as bad:
            return validation.Problem(bad.param, bad.message, code="invalid_workload").response(request_id)
    else:
        workload = ""
    call = Call(route=route, kind=kind, body=body, raw=raw, request_id=request_id, workload=workload)
    if route.mode != Mode.PROD:  # prod requests count when their stage record is written
        stage_metrics.count_passthrough(endpoint=route.name, mode=route.mode)
    return await capture.around(call, _by_mode, opt_out=capture.opted_out(no_capture), workload_header=workload_header)


async def _by_mode(call: Call) -> HttpResponseBase:
    route = call.route
    if route.mode == Mode.SHADOW:
        from speculation.gateway import shadow

        return await shadow.serve(call)
    if route.mode == Mode.PROD:
        from speculation.gateway import prod

        return await prod.serve(call)
    return await passthrough.forward(call)


async def _serve(request: HttpRequest, kind: str) -> HttpResponseBase:
    authorization = request.headers.get("Authorization", "")
    return await serve(
        kind=kind,
        method=request.method or "",
        authorization=authorization,
        raw=_body(request),
        workload_header=request.headers.get(workload_keys.HEADER),
        client=request.META.get("REMOTE_ADDR", ""),
        no_capture=request.headers.get(capture.OPT_OUT_HEADER),
    )


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponseBase:
    return await _serve(request, "chat")


@csrf_exempt
async def completions(request: HttpRequest) -> HttpResponseBase:
    return await _serve(request, "completion")


async def models(request: HttpRequest) -> HttpResponse:
    return await list_models(request.headers.get("Authorization", ""), client=request.META.get("REMOTE_ADDR", ""))


async def list_models(authorization: str, *, client: str = "") -> HttpResponse:
    """/v1/models: the endpoints this token may call, one entry each."""
    request_id = new_request_id()
    cache = route_cache()
    stamp = await cache.stamp()
    principal = await _caller(authorization, client, stamp=stamp, request_id=request_id)
    if isinstance(principal, HttpResponse):
        return principal
    table = await cache.table(stamp)
    created = int(time.time())
    seen: set[int] = set()
    data = []
    for route in table.values():
        if route.endpoint_id in seen or not principal.may_call(route.endpoint_id):
            continue
        seen.add(route.endpoint_id)
        data.append(
            {
                "id": route.name,
                "object": "model",
                "created": created,
                "owned_by": "ace",
                "root": route.served_model or None,
                "max_model_len": route.capabilities.get("max_context"),
                "ace_mode": route.mode,
            }
        )
    response = HttpResponse(json.dumps({"object": "list", "data": data}), content_type="application/json")
    response[REQUEST_ID_HEADER] = request_id
    return response

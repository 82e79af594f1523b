"""`python -m ace.launcher`: start the whole product on one machine with its embedded defaults.

Order: the demo model pair, Redis, migrations, the admin account (its credentials printed), the demo endpoint
(name "demo") registered as a managed endpoint of node class cpu with its candidates (the demo drafts and the
demo target's shipped EAGLE head; see ace.demo_drafts), a Celery worker (queues
control and gpu.cpu: its managed-server supervisor starts the real vLLM serving the demo target, probes it and
routes the endpoint to it, and switches that server when the mode changes), beat, and the web server (uvicorn,
ASGI) on http://127.0.0.1:8000; then it says when the demo endpoint serves. Ctrl-C stops it all (the worker stops its
supervisor, which stops vLLM).

Environment: ACE_WEB_HOST / ACE_WEB_PORT (127.0.0.1 / 8000), ACE_REDIS_PORT (default: a free port),
ACE_NO_VLLM=1 (no model server and no demo endpoint: the worker runs no supervisor), plus everything
ace.settings reads (ACE_MANAGED_START_TIMEOUT, ACE_MANAGED_CANARY, ...).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ace import processes
from ace.demo_drafts import DEMO_DRAFT, DEMO_EAGLE, eagle_ready, eagle_training_argv, register_demo_drafts

logger = logging.getLogger("ace.launcher")

ADMIN_USERNAME = "admin"
DEMO_ENDPOINT = "demo"
DEMO_MODEL_NAME = "ace-demo-target"
DEMO_NODE_CLASS = "cpu"
# As ace.processes.start_vllm runs the demo target on this CPU build.
DEMO_SERVER_ARGS = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True}
DEMO_WAIT_S = float(os.environ.get("ACE_MANAGED_START_TIMEOUT", "600")) + 60


class Launcher:
    def __init__(self) -> None:
        self.started: list[processes.ManagedProcess] = []
        self.side: list[processes.ManagedProcess] = []  # may finish on their own (the demo head's training)
        self.stopping = False

    def run(self) -> int:
        data_dir = Path(os.environ.get("ACE_DATA_DIR") or processes.REPO_ROOT / "var")
        log_dir = data_dir / "logs"
        web_host = os.environ.get("ACE_WEB_HOST", "127.0.0.1")
        web_port = int(os.environ.get("ACE_WEB_PORT", "8000"))
        os.environ["ACE_WEB_PORT"] = str(web_port)  # every process refuses endpoint URLs pointing at ACE itself
        with_vllm = os.environ.get("ACE_NO_VLLM", "").lower() not in ("1", "true", "yes")

        from speculation.offline.demo import ensure_demo_pair
        from speculation.offline.eagle.demo_head import default_head_dir

        say("locating the demo models (installed from the repository's models/ on a first run)")
        pair = ensure_demo_pair()
        say(f"demo target: {pair.target_dir}")

        redis = self._keep(
            processes.start_redis(
                workdir=data_dir / "redis", port=_int_env("ACE_REDIS_PORT"), log_dir=log_dir, timeout_s=20
            )
        )
        os.environ["REDIS_URL"] = redis.url
        say(f"redis: {redis.url}")

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        username, password = ensure_admin(data_dir)
        token = ensure_api_token(username)
        demo = None
        eagle_dir = str(default_head_dir(pair))
        if with_vllm:
            demo = register_demo_endpoint(
                target_dir=str(pair.target_dir),
                draft_dir=str(pair.draft_dir),
                extra_drafts={label: str(path) for label, path in pair.extra_drafts.items()},
                eagle_dir=eagle_dir,
            )

        # Prometheus multiprocess mode: the web and the worker count into one directory, emptied at each start.
        metrics_dir = data_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        child_env = {"REDIS_URL": redis.url, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        if not with_vllm:  # a managed demo endpoint kept from an earlier run must not start either
            child_env["ACE_MANAGED_SUPERVISOR"] = "false"
        self._keep(processes.start_celery_worker(env=child_env, log_dir=log_dir, queues="control,gpu.cpu"))
        self._keep(processes.start_celery_beat(env=child_env, log_dir=log_dir, workdir=data_dir / "beat"))
        web = self._keep(
            processes.start_asgi(name="web", host=web_host, port=web_port, env=child_env, log_dir=log_dir, quiet=False)
        )
        if demo is not None and not eagle_ready(eagle_dir):
            argv = eagle_training_argv(
                target_dir=str(pair.target_dir), eagle_dir=eagle_dir, target_name=DEMO_MODEL_NAME
            )
            self.side.append(processes.spawn("train-eagle", argv, log_path=log_dir / "train-eagle.log", env=child_env))
            say(f"training the demo target's EAGLE head in the background (minutes; log {log_dir}/train-eagle.log)")

        say("")
        say(f"ACE is running: {web.url}/")
        say(f"  admin login:  {username} / {password}")
        say(f"  API docs:     {web.url}/api/docs/")
        say(f"  API token:    {token}   (REST: 'Authorization: Token ...'; gateway: OpenAI(base_url='{web.url}/v1'))")
        if demo is not None:
            say(f"  demo endpoint '{DEMO_ENDPOINT}': managed; the worker's supervisor starts its vLLM (about a minute)")
        say(f"  logs:         {log_dir}")
        say("Press Ctrl-C to stop everything.")
        return self._watch(demo_wait_s=DEMO_WAIT_S if demo is not None else None)

    def _keep(self, proc: processes.ManagedProcess) -> processes.ManagedProcess:
        self.started.append(proc)
        return proc

    def _watch(self, demo_wait_s: float | None = None) -> int:
        """Until Ctrl-C: stop everything when one process dies; say once when the demo endpoint serves."""
        deadline = time.monotonic() + demo_wait_s if demo_wait_s else None
        while not self.stopping:
            for proc in self.started:
                if not proc.alive():
                    say(f"{proc.name} exited ({proc.popen.returncode}); stopping everything. Its log:")
                    say(proc.log_tail(20))
                    return 1
            if deadline is not None:
                line = demo_serving()
                if line or time.monotonic() > deadline:
                    say(line or f"demo endpoint '{DEMO_ENDPOINT}' not serving yet: {demo_status()} (see its page)")
                    deadline = None
            self._report_side()
            time.sleep(1)
        return 0

    def _report_side(self) -> None:
        """Say once when a background job (the demo head's training) ends, how it ended."""
        for proc in [p for p in self.side if not p.alive()]:
            self.side.remove(proc)
            if proc.popen.returncode == 0:
                say(f"{proc.name}: done; the demo target's EAGLE head is registered (a candidate of 'demo')")
            else:
                say(f"{proc.name} failed ({proc.popen.returncode}); it resumes at the next start. Its log:")
                say(proc.log_tail(10))

    def stop(self) -> None:
        self.stopping = True
        for proc in reversed(self.started + self.side):
            proc.stop()


def ensure_admin(data_dir: Path) -> tuple[str, str]:
    """The admin account; its password is kept (mode 0600) in the data directory so every run can print it."""
    from django.contrib.auth import get_user_model

    password_file = data_dir / "admin_password"
    user_model = get_user_model()
    user = user_model.objects.filter(username=ADMIN_USERNAME).first()
    if user is not None and password_file.exists() and user.check_password(password_file.read_text().strip()):
        return ADMIN_USERNAME, password_file.read_text().strip()
    password = secrets.token_urlsafe(12)
    if user is None:
        user_model.objects.create_superuser(ADMIN_USERNAME, email="", password=password)
    else:
        user.set_password(password)
        user.save(update_fields=["password"])
    password_file.write_text(password + "\n")
    password_file.chmod(0o600)
    return ADMIN_USERNAME, password


def ensure_api_token(username: str) -> str:
    """The admin's API token (created once), for the REST API and the OpenAI-compatible gateway."""
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    token, _ = Token.objects.get_or_create(user=get_user_model().objects.get(username=username))
    return token.key


def register_demo_endpoint(
    *, target_dir: str, draft_dir: str, extra_drafts: dict[str, str] | None = None, eagle_dir: str = ""
):
    """The demo endpoint as a managed endpoint (the worker's supervisor runs its vLLM, so a mode switch switches
    that server); one registered by URL by an earlier run becomes managed. Also its candidates (ace.demo_drafts:
    the demo draft, the version's other drafts by label, the EAGLE head in `eagle_dir` when built), and the
    target's directory on the policy (shadow replays sampled requests exactly with it). A new demo endpoint's
    policy drafts with `demo-eagle` at dynamic K (`demo-draft` where no head is registered) and `draft: auto`
    (prod runs each workload's best candidate once shadow has measured them). Returns the endpoint, or None (the
    reason printed) when it cannot be registered."""
    from django.contrib.auth import get_user_model
    from django.core.exceptions import ValidationError

    from fleet.managed.services import create_managed_endpoint
    from fleet.models import Endpoint

    admin = get_user_model().objects.filter(username=ADMIN_USERNAME).first()
    endpoint = Endpoint.objects.filter(name=DEMO_ENDPOINT).first()
    try:
        created = endpoint is None
        if endpoint is None:
            endpoint = create_managed_endpoint(
                name=DEMO_ENDPOINT,
                model_dir=target_dir,
                served_name=DEMO_MODEL_NAME,
                node_class=DEMO_NODE_CLASS,
                server_args=DEMO_SERVER_ARGS,
                created_by=admin,
            )
        else:
            make_demo_managed(endpoint, target_dir=target_dir, admin=admin)
        register_demo_drafts(
            drafts={"draft": draft_dir, **(extra_drafts or {})},
            eagle_dir=eagle_dir,
            target_name=DEMO_MODEL_NAME,
            owner=admin,
        )
        _demo_policy(endpoint, target_dir=target_dir, created=created)
    except ValidationError as exc:
        say(f"demo endpoint not registered: {'; '.join(exc.messages)}")
        return None
    return endpoint


def _demo_policy(endpoint, *, target_dir: str, created: bool) -> None:
    """Kept in the change history, by no user. Path local: prod on the demo is ACE's own speculation with the
    target in the worker, against the plain managed instance (the CPU vLLM's own speculation fails the switch
    canary); path auto or native would switch the server instead."""
    from speculation.models import DraftKind, DraftModel, Mode, VerificationPath
    from speculation.services.policies import get_policy, update_policy

    policy = get_policy(endpoint=endpoint)
    fields: dict = {}
    if policy.target_path != target_dir:
        fields["target_path"] = target_dir
        if policy.mode != Mode.PROD and policy.path == VerificationPath.AUTO:
            fields["path"] = VerificationPath.LOCAL
    if created:
        head = DraftModel.objects.filter(name=DEMO_EAGLE, kind=DraftKind.EAGLE_HEAD).first()
        if head is not None:  # the shipped head: its chain at dynamic K is the demo's fastest pairing on a CPU
            fields.update(mechanism=DraftKind.EAGLE_HEAD, draft=head, dynamic_k=True, auto_pairing=True)
        else:
            draft = DraftModel.objects.get(name=DEMO_DRAFT)
            fields.update(mechanism=DraftKind.DRAFT_MODEL, draft=draft, auto_pairing=True)
    if fields:
        update_policy(endpoint=endpoint, **fields)


def make_demo_managed(endpoint, *, target_dir: str, admin) -> None:
    """The demo endpoint of an earlier run at this start: one registered by URL becomes managed (its policy
    leaves prod unless prod runs on ACE's local or remote path); a managed one follows a rebuilt demo
    target. Either way it waits for this run's worker to start its server."""
    from django.db import transaction

    from fleet.managed.args import validate_server_args
    from fleet.managed.models import ManagedServer
    from fleet.managed.services import NOT_STARTED_URL
    from fleet.models import Endpoint, EndpointStatus, ServerKind
    from speculation.models import Mode, VerificationPath
    from speculation.services.policies import get_policy, update_policy

    managed = ManagedServer.objects.filter(endpoint=endpoint).first()
    with transaction.atomic():
        if managed is None:
            ManagedServer.objects.create(
                endpoint=endpoint,
                model_dir=target_dir,
                served_name=DEMO_MODEL_NAME,
                server_args=validate_server_args(DEMO_SERVER_ARGS),
            )
        elif managed.model_dir != target_dir:
            ManagedServer.objects.filter(pk=managed.pk).update(model_dir=target_dir)
        # Nothing serves it before this run's worker starts its server (the URL of the last run is gone).
        Endpoint.objects.filter(pk=endpoint.pk).update(
            base_url=NOT_STARTED_URL,
            kind=ServerKind.VLLM,
            node_class=DEMO_NODE_CLASS,
            owner=endpoint.owner or admin,
            status=EndpointStatus.NEW,
            status_reason=f"managed: waiting for the supervisor of node class {DEMO_NODE_CLASS}",
        )
    if managed is None:
        policy = get_policy(endpoint=endpoint)
        if policy.mode == Mode.PROD and policy.path not in (VerificationPath.LOCAL, VerificationPath.REMOTE):
            update_policy(endpoint=endpoint, mode=Mode.OFF)
        say(f"demo endpoint '{DEMO_ENDPOINT}' is now a managed endpoint (its server is run by the worker)")


def demo_serving() -> str:
    """A line saying where the demo endpoint serves, once its managed vLLM is ready and routed ("" until then)."""
    from fleet.managed.services import NOT_STARTED_URL
    from fleet.models import Endpoint, EndpointStatus

    endpoint = Endpoint.objects.filter(name=DEMO_ENDPOINT).first()
    if endpoint is None or endpoint.status != EndpointStatus.READY or endpoint.base_url == NOT_STARTED_URL:
        return ""
    return f"demo endpoint '{DEMO_ENDPOINT}' serving: managed vLLM on {endpoint.base_url} (model {DEMO_MODEL_NAME})"


def demo_status() -> str:
    from fleet.models import Endpoint

    endpoint = Endpoint.objects.filter(name=DEMO_ENDPOINT).first()
    return f"{endpoint.status}, {endpoint.status_reason}" if endpoint is not None else "not registered"


def say(message: str) -> None:
    print(message, flush=True)  # a CLI: its output is for the person who ran it


def _int_env(name: str) -> int | None:
    raw = os.environ.get(name)
    return int(raw) if raw else None


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    launcher = Launcher()

    def on_signal(signum: int, frame: object) -> None:
        launcher.stopping = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)  # also when started with SIGINT ignored (a background job)
    try:
        return launcher.run()
    except KeyboardInterrupt:
        say("stopping...")
        return 0
    except (processes.ProcessFailed, subprocess.SubprocessError) as exc:
        say(f"start-up failed: {exc}")
        return 1
    finally:
        launcher.stop()


if __name__ == "__main__":
    sys.exit(main())

"""`python -m ace.launcher`: start the whole product on one machine with its embedded defaults.

Order: the demo model pair, Redis, a real vLLM serving the demo target, migrations, the admin account (its
credentials printed), the demo endpoint (name "demo") registered and its probe queued, a Celery worker (queues
control and gpu.cpu), beat, and the web server (uvicorn, ASGI) on http://127.0.0.1:8000. Ctrl-C stops it all.

Environment: ACE_WEB_HOST / ACE_WEB_PORT (127.0.0.1 / 8000), ACE_REDIS_PORT and ACE_VLLM_PORT (default: free
ports), ACE_NO_VLLM=1 (skip the model server and the demo endpoint), plus everything ace.settings reads.
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

logger = logging.getLogger("ace.launcher")

ADMIN_USERNAME = "admin"
DEMO_ENDPOINT = "demo"
DEMO_MODEL_NAME = "ace-demo-target"
DEMO_DRAFT = "demo-draft"


class Launcher:
    def __init__(self) -> None:
        self.started: list[processes.ManagedProcess] = []
        self.stopping = False

    def run(self) -> int:
        data_dir = Path(os.environ.get("ACE_DATA_DIR") or processes.REPO_ROOT / "var")
        log_dir = data_dir / "logs"
        web_host = os.environ.get("ACE_WEB_HOST", "127.0.0.1")
        web_port = int(os.environ.get("ACE_WEB_PORT", "8000"))
        os.environ["ACE_WEB_PORT"] = str(web_port)  # every process refuses endpoint URLs pointing at ACE itself
        with_vllm = os.environ.get("ACE_NO_VLLM", "").lower() not in ("1", "true", "yes")

        from speculation.offline.demo import ensure_demo_pair

        say("building or locating the demo model pair (first run: a few minutes)")
        pair = ensure_demo_pair()
        say(f"demo target: {pair.target_dir}")

        redis = self._keep(
            processes.start_redis(
                workdir=data_dir / "redis", port=_int_env("ACE_REDIS_PORT"), log_dir=log_dir, timeout_s=20
            )
        )
        os.environ["REDIS_URL"] = redis.url
        say(f"redis: {redis.url}")

        vllm = None
        if with_vllm:
            say("starting vLLM for the demo target (about a minute on 2 cores)")
            vllm = self._keep(
                processes.start_vllm(
                    model_dir=pair.target_dir,
                    served_model_name=DEMO_MODEL_NAME,
                    port=_int_env("ACE_VLLM_PORT"),
                    log_dir=log_dir,
                )
            )
            say(f"vLLM: {vllm.url} (model {DEMO_MODEL_NAME})")

        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "ace.settings")
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", interactive=False, verbosity=0)
        username, password = ensure_admin(data_dir)
        token = ensure_api_token(username)
        if vllm is not None:
            register_demo_endpoint(vllm.url, target_dir=str(pair.target_dir), draft_dir=str(pair.draft_dir))

        # Prometheus multiprocess mode: the web and the worker count into one directory, emptied at each start.
        metrics_dir = data_dir / "metrics"
        shutil.rmtree(metrics_dir, ignore_errors=True)
        metrics_dir.mkdir(parents=True)
        child_env = {"REDIS_URL": redis.url, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir)}
        self._keep(processes.start_celery_worker(env=child_env, log_dir=log_dir, queues="control,gpu.cpu"))
        self._keep(processes.start_celery_beat(env=child_env, log_dir=log_dir, workdir=data_dir / "beat"))
        web = self._keep(
            processes.start_asgi(name="web", host=web_host, port=web_port, env=child_env, log_dir=log_dir, quiet=False)
        )

        say("")
        say(f"ACE is running: {web.url}/")
        say(f"  admin login:  {username} / {password}")
        say(f"  API docs:     {web.url}/api/docs/")
        say(f"  API token:    {token}   (REST: 'Authorization: Token ...'; gateway: OpenAI(base_url='{web.url}/v1'))")
        if vllm is not None:
            say(f"  demo endpoint '{DEMO_ENDPOINT}' -> {vllm.url}")
        say(f"  logs:         {log_dir}")
        say("Press Ctrl-C to stop everything.")
        return self._watch()

    def _keep(self, proc: processes.ManagedProcess) -> processes.ManagedProcess:
        self.started.append(proc)
        return proc

    def _watch(self) -> int:
        while not self.stopping:
            for proc in self.started:
                if not proc.alive():
                    say(f"{proc.name} exited ({proc.popen.returncode}); stopping everything. Its log:")
                    say(proc.log_tail(20))
                    return 1
            time.sleep(1)
        return 0

    def stop(self) -> None:
        self.stopping = True
        for proc in reversed(self.started):
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


def register_demo_endpoint(base_url: str, *, target_dir: str, draft_dir: str) -> None:
    """Register (or point at this run's port) the demo endpoint and queue its probe; register the demo draft
    and give the endpoint's policy the target's directory, so that prod (remote or local path) is one click away.
    """
    from django.contrib.auth import get_user_model
    from django.core.exceptions import ValidationError
    from django.db import transaction

    from fleet.models import Endpoint, ServerKind
    from fleet.tasks import start_probe
    from speculation.models import DraftKind, DraftModel
    from speculation.services.drafts import register_draft
    from speculation.services.policies import get_policy, reevaluate_path, update_policy

    with transaction.atomic():
        defaults = {"base_url": base_url, "kind": ServerKind.VLLM, "node_class": "cpu"}
        admin = get_user_model().objects.filter(username=ADMIN_USERNAME).first()
        endpoint, _ = Endpoint.objects.update_or_create(
            name=DEMO_ENDPOINT, defaults=defaults, create_defaults={**defaults, "owner": admin, "created_by": admin}
        )
        if endpoint.owner_id is None:  # registered by a run before endpoints had owners
            Endpoint.objects.filter(pk=endpoint.pk).update(owner=admin)
        start_probe(endpoint)
    if not DraftModel.objects.filter(name=DEMO_DRAFT).exists():
        register_draft(
            name=DEMO_DRAFT, kind=DraftKind.DRAFT_MODEL, path=draft_dir, node_class="cpu", target_name=DEMO_MODEL_NAME
        )
    if get_policy(endpoint=endpoint).target_path != target_dir:
        update_policy(endpoint=endpoint, target_path=target_dir)  # kept in the change history, by no user
    policy = get_policy(endpoint=endpoint)
    if policy.path == "auto" and policy.path_resolved_at is None:  # saved before auto was fixed on save
        try:
            reevaluate_path(endpoint=endpoint)  # auto -> local (the demo's fastest path), recorded
        except ValidationError as exc:
            say(f"demo policy: path auto not resolved: {'; '.join(exc.messages)}")


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

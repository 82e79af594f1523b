"""Speculation: draft artifacts, per-endpoint policy (with its history), and per-request stage records."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models.functions import Lower

from fleet.models import Endpoint
from speculation.engine.families import implementation_of
from speculation.kinds import (  # noqa: F401 - the kinds are read from here too
    HYBRID_PREFIX,
    LOOKUP_KINDS,
    REGISTRABLE_KINDS,
    DraftKind,
    Mechanism,
    Mode,
    VerificationPath,
)
from speculation.limits import DEFAULT_K


class DraftModel(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    kind = models.CharField(max_length=16, choices=DraftKind.choices)
    path = models.CharField(max_length=1000, blank=True, default="")
    tokenizer_fingerprint = models.CharField(max_length=64, blank=True, default="")
    vocab_size = models.PositiveIntegerField(null=True, blank=True)
    param_count = models.BigIntegerField(null=True, blank=True)
    vram_bytes = models.BigIntegerField(null=True, blank=True)
    node_class = models.SlugField(max_length=64, default="cpu")
    target_name = models.CharField(max_length=255, blank=True, default="")
    config = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # Who may see and delete it (fleet.permissions, as for endpoints): its owner, its team, admins. Neither set:
    # admins only.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="owned_drafts"
    )
    team = models.ForeignKey("auth.Group", null=True, blank=True, on_delete=models.SET_NULL, related_name="team_drafts")

    class Meta:
        ordering = ["name"]
        # One name in any letter case: "DEMO-DRAFT" beside "demo-draft" would read as the same draft.
        constraints = [models.UniqueConstraint(Lower("name"), name="draft_name_unique_any_case")]

    def __str__(self) -> str:
        return self.name

    @property
    def implementation(self) -> str | None:
        """How ACE's engine runs a draft model: "native" (its own layer) or "generic" (transformers' model: exact,
        slower, batch one), from config.json's model_type read at registration; None for other kinds."""
        if self.kind != DraftKind.DRAFT_MODEL:
            return None
        return implementation_of((self.config or {}).get("model_type"))


class SpeculationPolicy(models.Model):
    endpoint = models.OneToOneField(Endpoint, related_name="policy", on_delete=models.CASCADE)
    mode = models.CharField(max_length=8, choices=Mode.choices, default=Mode.OFF)
    mechanism = models.CharField(max_length=16, choices=Mechanism.choices, default=Mechanism.NGRAM)
    draft = models.ForeignKey(DraftModel, null=True, blank=True, on_delete=models.PROTECT)
    k = models.PositiveSmallIntegerField(default=DEFAULT_K)
    dynamic_k = models.BooleanField(default=False)
    # EAGLE heads only: an EAGLE-2 draft tree {"top_k", "depth", "nodes"[, "score_temperature"]} verified in one
    # target pass (speculation.engine.tree); {} drafts a chain of K. K caps the tree's depth.
    eagle_tree = models.JSONField(default=dict, blank=True)
    # "draft: auto": ACE applies auto-pairing's winner (candidate and K) itself, with hysteresis and a minimum of
    # evidence (speculation.services.autopairing.auto_apply); each switch is a change recorded as "auto".
    auto_pairing = models.BooleanField(default=False)
    shadow_sample_rate = models.FloatField(default=1.0)
    path = models.CharField(max_length=8, choices=VerificationPath.choices, default=VerificationPath.AUTO)
    # For path local: the target's model directory on the node class, loaded by ACE's own GPU worker.
    target_path = models.CharField(max_length=1000, blank=True, default="")
    # What path auto means, fixed when the policy is saved or re-evaluated (speculation.services.path_choice):
    # the chosen path ("" when none is eligible) and the evidence of every path at that moment.
    resolved_path = models.CharField(max_length=8, blank=True, default="")
    path_evidence = models.JSONField(default=list, blank=True)
    path_resolved_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)

    def __str__(self) -> str:
        return f"policy of {self.endpoint_id}: {self.mode}"


class PolicyChange(models.Model):
    """Every change of a policy, with who and when: {field: [old, new]}."""

    policy = models.ForeignKey(SpeculationPolicy, related_name="changes", on_delete=models.CASCADE)
    changed_at = models.DateTimeField(auto_now_add=True, db_index=True)
    changed_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)
    changes = models.JSONField(default=dict)

    class Meta:
        ordering = ["-changed_at", "-id"]


class Action(models.TextChoices):
    WOULD_SPECULATE = "would_speculate", "Would speculate"
    SPECULATED = "speculated", "Speculated"
    SKIPPED = "skipped", "Skipped"
    FELL_BACK = "fell_back", "Fell back"


class StageRecord(models.Model):
    """One request the speculative_decoding stage saw."""

    endpoint = models.ForeignKey(Endpoint, related_name="stage_records", on_delete=models.CASCADE)
    request_id = models.CharField(max_length=64, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)
    mode = models.CharField(max_length=8, choices=Mode.choices)
    action = models.CharField(max_length=16, choices=Action.choices)
    # the request's workload key (speculation.workloads.keys: given by the client or the prompt's category)
    workload = models.CharField(max_length=64, blank=True, default="")
    reason = models.TextField(blank=True, default="")
    path = models.CharField(max_length=8, blank=True, default="")
    mechanism = models.CharField(max_length=16, blank=True, default="")
    k = models.PositiveSmallIntegerField(null=True, blank=True)
    drafted_tokens = models.PositiveIntegerField(default=0)
    accepted_tokens = models.PositiveIntegerField(default=0)
    target_passes = models.PositiveIntegerField(default=0)
    per_position_acceptance = models.JSONField(default=list, blank=True)
    accepted_length_hist = models.JSONField(default=list, blank=True)
    # accepted / drafted (vLLM's "draft acceptance rate"; not alpha).
    acceptance_rate = models.FloatField(null=True, blank=True)
    # alpha-style: mean per-position acceptance probability.
    alpha = models.FloatField(null=True, blank=True)
    # tokens per verification step, bonus token included (EAGLE's tau).
    mean_accepted_len = models.FloatField(null=True, blank=True)
    # shadow of sampled traffic from a server's top-N log-probabilities: alpha is then a lower bound, and this is
    # the mean probability mass (per position) the bound could not attribute; null when alpha is exact.
    unseen_mass = models.FloatField(null=True, blank=True)
    output_tokens = models.PositiveIntegerField(default=0)
    tok_s = models.FloatField(null=True, blank=True)
    baseline_tok_s = models.FloatField(null=True, blank=True)
    multiplier = models.FloatField(null=True, blank=True)
    # the server's plain decode step (ms) the multiplier is over: a stored cost calibration's, the same for shadow's
    # projection and prod's measurement; null where the multiplier is over baseline_tok_s (no calibration yet)
    server_step_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["endpoint", "created_at"]),
            models.Index(fields=["endpoint", "action", "created_at"]),
            # time ranges across endpoints: the dashboard's rollup fill and its fleet-wide raw edges
            models.Index(fields=["created_at"], name="stagerecord_created_idx"),
        ]

    def __str__(self) -> str:
        return f"{self.request_id}: {self.mode}/{self.action}"


class StageRollup(models.Model):
    """Stage records summed per endpoint, minute, mode, action, workload and K (selectors.rollup_store fills it).

    Only sums and counts, so buckets add up to any coarser bucket; the charts read these rows plus the raw
    records of the last minutes that are not rolled up yet. p1..p16 (K_MAX): per-position acceptance rate times
    target passes, summed (the passes-weighted rate is p_i / passes); h0..h16: accepted-length histogram.
    Minutes older than settings.ROLLUP_RETENTION are merged into one row per hour (`seconds` 3600).
    """

    endpoint = models.ForeignKey(Endpoint, related_name="stage_rollups", on_delete=models.CASCADE)
    bucket_start = models.DateTimeField()
    seconds = models.PositiveIntegerField(default=60)  # the bucket's width: 60, or 3600 once merged into hours
    mode = models.CharField(max_length=8, choices=Mode.choices)
    action = models.CharField(max_length=16, choices=Action.choices)
    workload = models.CharField(max_length=64, blank=True, default="")
    k = models.PositiveSmallIntegerField(default=0)  # the records' K; 0: none (skipped, fell back)
    n = models.PositiveIntegerField(default=0)
    n_spec = models.PositiveIntegerField(default=0)  # records that drafted something
    drafted = models.BigIntegerField(default=0)
    accepted = models.BigIntegerField(default=0)
    passes = models.BigIntegerField(default=0)
    k_sum = models.BigIntegerField(default=0)
    k_n = models.PositiveIntegerField(default=0)
    alpha_sum = models.FloatField(default=0.0)
    alpha_n = models.PositiveIntegerField(default=0)
    mal_sum = models.FloatField(default=0.0)
    mal_n = models.PositiveIntegerField(default=0)
    mult_sum = models.FloatField(default=0.0)
    mult_n = models.PositiveIntegerField(default=0)
    tok_s_sum = models.FloatField(default=0.0)
    tok_s_n = models.PositiveIntegerField(default=0)
    base_sum = models.FloatField(default=0.0)
    base_n = models.PositiveIntegerField(default=0)
    p1 = models.FloatField(default=0.0)
    p2 = models.FloatField(default=0.0)
    p3 = models.FloatField(default=0.0)
    p4 = models.FloatField(default=0.0)
    p5 = models.FloatField(default=0.0)
    p6 = models.FloatField(default=0.0)
    p7 = models.FloatField(default=0.0)
    p8 = models.FloatField(default=0.0)
    p9 = models.FloatField(default=0.0)
    p10 = models.FloatField(default=0.0)
    p11 = models.FloatField(default=0.0)
    p12 = models.FloatField(default=0.0)
    p13 = models.FloatField(default=0.0)
    p14 = models.FloatField(default=0.0)
    p15 = models.FloatField(default=0.0)
    p16 = models.FloatField(default=0.0)
    h0 = models.BigIntegerField(default=0)
    h1 = models.BigIntegerField(default=0)
    h2 = models.BigIntegerField(default=0)
    h3 = models.BigIntegerField(default=0)
    h4 = models.BigIntegerField(default=0)
    h5 = models.BigIntegerField(default=0)
    h6 = models.BigIntegerField(default=0)
    h7 = models.BigIntegerField(default=0)
    h8 = models.BigIntegerField(default=0)
    h9 = models.BigIntegerField(default=0)
    h10 = models.BigIntegerField(default=0)
    h11 = models.BigIntegerField(default=0)
    h12 = models.BigIntegerField(default=0)
    h13 = models.BigIntegerField(default=0)
    h14 = models.BigIntegerField(default=0)
    h15 = models.BigIntegerField(default=0)
    h16 = models.BigIntegerField(default=0)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["endpoint", "bucket_start", "mode", "action", "workload", "k"], name="stage_rollup_key"
            )
        ]
        indexes = [models.Index(fields=["bucket_start", "endpoint"])]


class RollupState(models.Model):
    """How far StageRollup is filled: every record created before `rolled_until` is in it."""

    name = models.CharField(max_length=32, unique=True)
    rolled_until = models.DateTimeField(null=True, blank=True)


class TrainingStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class TrainingKind(models.TextChoices):
    """What a training run trains: an EAGLE head for a target, or a draft model distilled on captured traffic."""

    EAGLE_HEAD = "eagle_head", "EAGLE head"
    DRAFT_MODEL = "draft_model", "Draft distillation"


class TrainingRun(models.Model):
    """One training run: its inputs, progress (polled by the dashboard) and the draft it registered (an EAGLE head,
    or for kind draft_model a draft model distilled on captured traffic: speculation.services.draft_distillation).

    `log` holds one entry per finished epoch: {"epoch", "loss", "feature_loss", "token_loss", "alpha",
    "mean_accepted_len", "seconds"}; the run resumes from the checkpoint in `out_dir` after a crash.
    """

    name = models.SlugField(max_length=64)
    kind = models.CharField(max_length=16, choices=TrainingKind.choices, default=TrainingKind.EAGLE_HEAD)
    # EAGLE head: the target's directory; draft distillation: the draft model's it continues from
    target_dir = models.CharField(max_length=1000)
    target_name = models.CharField(max_length=255, blank=True, default="")
    out_dir = models.CharField(max_length=1000)
    prompts = models.CharField(max_length=1000, blank=True, default="", help_text="spec_bench or a prompt file")
    node_class = models.SlugField(max_length=64, default="cpu")
    seed = models.IntegerField(default=0)
    epochs = models.PositiveIntegerField(default=4)
    config = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=8, choices=TrainingStatus.choices, default=TrainingStatus.QUEUED)
    stage = models.CharField(max_length=32, blank=True, default="")
    epoch = models.PositiveIntegerField(default=0)
    loss = models.FloatField(null=True, blank=True)
    # Greedy acceptance of the head on held-out prompts: alpha per position and tokens per verification step.
    alpha = models.FloatField(null=True, blank=True)
    mean_accepted_len = models.FloatField(null=True, blank=True)
    log = models.JSONField(default=list, blank=True)
    error = models.TextField(blank=True, default="")
    draft = models.ForeignKey(DraftModel, null=True, blank=True, on_delete=models.SET_NULL)
    # As a draft's: the run, its error text and the head it registers are seen by its owner, its team and admins.
    owner = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="owned_training_runs"
    )
    team = models.ForeignKey(
        "auth.Group", null=True, blank=True, on_delete=models.SET_NULL, related_name="team_training_runs"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return f"training {self.name}: {self.status} epoch {self.epoch}/{self.epochs}"

    @property
    def progress(self) -> float:
        return min(1.0, self.epoch / self.epochs) if self.epochs else 0.0


class CostCalibration(models.Model):
    """The step costs shadow's projection divides by, as a GPU worker measured them on the endpoint's node class
    (speculation.worker.costs): the server's plain decode step, one draft step, and a verification of n tokens on
    prod's path; each from repeated timings (speculation.engine.costs). c = draft step / target step,
    v(K) = verify(K + 1) / target step (speculation.engine.projection.StepCosts)."""

    endpoint = models.ForeignKey(Endpoint, related_name="cost_calibrations", on_delete=models.CASCADE)
    draft = models.ForeignKey(DraftModel, null=True, blank=True, on_delete=models.CASCADE)
    node_class = models.SlugField(max_length=64)
    path = models.CharField(max_length=8, choices=VerificationPath.choices)
    measured_at = models.DateTimeField(auto_now_add=True, db_index=True)
    target_step_ms = models.FloatField()
    draft_step_ms = models.FloatField()
    verify_ms = models.JSONField(default=dict)  # tokens verified (K + 1, as a string key) -> ms
    repeats = models.PositiveSmallIntegerField(default=0)
    context_tokens = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["-measured_at", "-id"]

    def __str__(self) -> str:
        return f"costs of {self.endpoint_id} on {self.node_class}/{self.path} at {self.measured_at:%Y-%m-%d %H:%M:%S}"

    def step_costs(self):  # -> speculation.engine.projection.StepCosts
        from speculation.engine.projection import StepCosts

        return StepCosts(
            target_step_s=self.target_step_ms / 1000.0,
            draft_step_s=self.draft_step_ms / 1000.0,
            verify_s={int(n): ms / 1000.0 for n, ms in self.verify_ms.items()},
        )


class CandidateStatus(models.TextChoices):
    MEASURED = "measured", "Measured"
    SHED = "shed", "Shed (over the replay budget)"
    FAILED = "failed", "Failed"


class CandidateMeasurement(models.Model):
    """One candidate (a compatible draft model, or n-gram lookup) replayed on one shadowed request at every K.

    Written by speculation.worker.candidates beside the request's stage record. Per K = 1..len(mean_accepted_len)
    (index K - 1): tokens per verification step with the bonus token, the projected multiplier (None when the
    costs could not be measured), drafted / accepted tokens and verification steps, and the acceptance rate at
    each draft position. A shed or failed row has no values, only the reason.
    """

    endpoint = models.ForeignKey(Endpoint, related_name="candidate_measurements", on_delete=models.CASCADE)
    request_id = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    workload = models.CharField(max_length=64, blank=True, default="")
    candidate = models.CharField(max_length=64)  # "ngram" or the draft's name
    kind = models.CharField(max_length=16, choices=DraftKind.choices)
    draft = models.ForeignKey(DraftModel, null=True, blank=True, on_delete=models.SET_NULL)
    status = models.CharField(max_length=8, choices=CandidateStatus.choices, default=CandidateStatus.MEASURED)
    reason = models.TextField(blank=True, default="")
    output_tokens = models.PositiveIntegerField(default=0)
    mean_accepted_len = models.JSONField(default=list, blank=True)
    multiplier = models.JSONField(default=list, blank=True)
    counts = models.JSONField(default=list, blank=True)  # per K: [drafted, accepted, verification steps]
    per_position = models.JSONField(default=list, blank=True)  # per K: acceptance rate at positions 1..K
    best_k = models.PositiveSmallIntegerField(null=True, blank=True)
    best_multiplier = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["endpoint", "created_at"], name="candidate_endpoint_created_idx")]

    def __str__(self) -> str:
        return f"{self.request_id} x {self.candidate}: {self.status}"


class CaptureSetting(models.Model):
    """An endpoint's opt-in to traffic capture (off unless enabled): which fraction of its requests the gateway keeps
    with their served output as token ids (CapturedRequest), for how long and up to what size. Read and changed by
    admins of the endpoint's team only (fleet.permissions.check_captures)."""

    endpoint = models.OneToOneField(Endpoint, related_name="capture_setting", on_delete=models.CASCADE)
    enabled = models.BooleanField(default=False)
    sample_rate = models.FloatField(default=0.1)  # 0-1: the fraction of requests kept
    retention_days = models.PositiveIntegerField(default=30)
    max_bytes = models.BigIntegerField(default=256 * 1024 * 1024)  # the endpoint's captures, encrypted, at most
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL)

    def __str__(self) -> str:
        return f"capture of {self.endpoint_id}: {'on' if self.enabled else 'off'}"


class CapturedRequest(models.Model):
    """One captured request: its prompt and the output the endpoint served, as token ids, encrypted at rest.

    `sealed` is fleet.crypto.seal of the packed ids (speculation.services.captures.pack); only its sizes are stored
    in the clear. Deleted with its endpoint, past its setting's retention, and oldest first beyond its size cap.
    """

    endpoint = models.ForeignKey(Endpoint, related_name="captured_requests", on_delete=models.CASCADE)
    created_at = models.DateTimeField(auto_now_add=True)
    workload = models.CharField(max_length=64, blank=True, default="")
    mode = models.CharField(max_length=8, choices=Mode.choices)  # the mode that served it
    prompt_tokens = models.PositiveIntegerField(default=0)
    output_tokens = models.PositiveIntegerField(default=0)
    size_bytes = models.PositiveIntegerField(default=0)  # len(sealed)
    # served greedily (temperature 0): a replay of its output is exact (held-out replays read only these)
    greedy = models.BooleanField(default=False)
    sealed = models.TextField()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["endpoint", "created_at"], name="capture_endpoint_created_idx")]

    def __str__(self) -> str:
        return f"capture {self.pk} of {self.endpoint_id} ({self.workload or 'no workload'})"

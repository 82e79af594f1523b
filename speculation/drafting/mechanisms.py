"""One class per draft mechanism: what it is (does it look up, batch, read the target's features, draft a tree),
where it can run, its native launch flags per server kind, and how it drafts in prod and replays in shadow.

Torch-free: the web process reads the facts (policies, native flags); the proposers and replays are built by
speculation.drafting.build, imported where first used so that reading a fact never loads torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from django.conf import settings

from speculation.engine.eagle_format import FORMAT_EAGLE3, head_format, read_config
from speculation.kinds import HYBRID_PREFIX, DraftKind, VerificationPath
from speculation.limits import tree_expansion

# ACE's suffix decoding's frequency cut and spec factor (speculation.engine.suffix.MIN_TOKEN_PROB, MAX_SPEC_FACTOR;
# not imported: the web process loads no torch. tests/speculation/selectors/test_native_flags.py checks they agree).
SUFFIX_MIN_TOKEN_PROB = 0.1
SUFFIX_MAX_SPEC_FACTOR = 2.0
# vLLM's n-gram matcher: longest and shortest suffix of the context to look up (ACE's NgramProposer defaults).
NGRAM_LOOKUP_MAX = 3
NGRAM_LOOKUP_MIN = 1

EAGLE_NOT_REMOTE = (
    "an EAGLE head reads the target's hidden states, which a scoring call does not return: use path local (ACE's "
    "engine runs the target) or native (the server runs the head)"
)
SUFFIX_DRAFT_NOT_NATIVE = (
    "suffix decoding with a draft model's fallback runs in ACE's worker (path local or remote): a server runs one "
    "speculation method, so on path native choose suffix or draft_model"
)
# What a draft directory of a mechanism holds (Drafting.weights): a model's weights or an EAGLE head's.
MODEL_WEIGHTS = "model"
HEAD_WEIGHTS = "head"
SUFFIX_NOT_MANAGED = (
    "suffix decoding on the server needs vLLM with Arctic Inference (method 'suffix'), which ACE's managed servers "
    "do not install: use path local or remote (ACE's own suffix decoding), or run the server yourself with the "
    "endpoint's native flags"
)


Asked = Callable[[], Any] | None  # a question about the endpoint, asked only where the answer matters


def head_format_of(draft_path: str) -> int:
    """The head format in the directory's config.json (1 when it is not readable here: the directory may lie on the
    server's machine only, and then the operator picks the method)."""
    config = read_config(draft_path) if draft_path else None
    return head_format(config) if config is not None else 1


def _sglang_steps(k: int, tree: dict | None) -> list[str]:
    """Steps, top-k and draft tokens: a chain of K (top-k 1, K + 1 tokens: the root plus the drafts) or the
    policy's tree (K caps its depth as on ACE's path; the nodes plus the root are verified)."""
    if not tree:
        steps, top_k, tokens = k, 1, k + 1
    else:
        steps, top_k = min(tree["depth"], k), tree["top_k"]
        tokens = min(tree["nodes"], tree_expansion(top_k, steps)) + 1  # no more nodes than the steps expand
    return ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(top_k),
            "--speculative-num-draft-tokens", str(tokens)]  # fmt: skip


def _build() -> Any:
    from speculation.drafting import build  # torch: only where a proposer or a replay is wanted

    return build


class Measure(Protocol):
    """A measurement done one way per mechanism (shadow's greedy and sampled replays): the mechanism picks its own."""

    def lookup(self) -> Any: ...
    def draft_model(self) -> Any: ...
    def hybrid(self) -> Any: ...
    def eagle(self) -> Any: ...


class Drafting:
    """A draft mechanism. Subclasses set the facts and build their proposers through speculation.drafting.build."""

    kind: ClassVar[str]
    looks_up: ClassVar[bool] = False  # drafts by looking tokens up: no weights, no draft named by the policy
    lookup_kind: ClassVar[str] = ""  # the lookup it drafts with ("" for none)
    batches: ClassVar[bool] = True  # served by the worker's batch loop on the local path
    reads_target_features: ClassVar[bool] = False  # drafts from the target's hidden states (needs it in the worker)
    drafts_trees: ClassVar[bool] = False  # drafts the policy's EAGLE-2 tree
    model_steps: ClassVar[bool] = True  # every proposal is a model's chain of K (no lookup): timed by its steps
    native_names: ClassVar[dict[str, str]] = {}  # server kind -> its method / algorithm for this mechanism
    weights: ClassVar[str] = MODEL_WEIGHTS  # what its draft's directory holds ("" for none: it looks up)
    registrable: ClassVar[bool] = True  # a draft of this kind can be registered (else it is a policy's mechanism)

    @property
    def draft_kind(self) -> str:
        """The kind of the registered draft a policy with this mechanism names."""
        return self.kind

    def candidate_name(self, draft: Any) -> str:
        """The auto-pairing candidate a policy of this mechanism with `draft` is ("" when a draft is missing)."""
        return draft.name if draft is not None else ""

    def draft_name(self, candidate: str) -> str:
        """The draft a candidate of this mechanism names (candidate_name's inverse; a lookup's is its kind)."""
        return candidate

    def native_name(self, server_kind: str, draft_path: str = "") -> str | None:
        """The method (vLLM) or algorithm (SGLang) that runs it on a server of this kind, None if none does."""
        return self.native_names.get(server_kind)

    def vllm_config(self, draft_path: str) -> tuple[dict[str, Any], list[str]]:
        """Its --speculative-config entries besides method and K, and what the operator should know."""
        return {"model": draft_path}, [
            "model is the draft's path on the server's machine: copy the directory there if it differs."
        ]

    def native_stand_in(self, draft_name: str) -> str | None:
        """What the operator should know when a server runs the policy's draft in its stead (None: it runs it)."""
        return None

    def sglang_args(self, draft_path: str, k: int, tree: dict | None) -> tuple[list[str], list[str]]:
        """Its SGLang launch arguments besides the algorithm, and what the operator should know."""
        args = ["--speculative-draft-model-path", draft_path, *_sglang_steps(k, tree)]
        return args, ["--speculative-draft-model-path is the draft's path on the server's machine."]

    def measured_by(self, measure: Measure) -> Any:
        """Runs the measurement's way for this mechanism."""
        return measure.draft_model()

    def sampled_exact(self, tree: Any = None) -> bool:
        """Whether its replay on a sampled request is exact (one-hot drafts pass exactly where the sampled token is
        theirs), else expected from the draft's probability of passing."""
        return self.looks_up

    def path_problem(self, path: str, *, managed: Asked = None, head_problem: Asked = None) -> str | None:
        """Why it cannot run on `path` of the endpoint, or None. What it may ask about the endpoint, only where it
        matters (None: not asked): managed, whether ACE starts its server; head_problem, why its server cannot
        run the policy's EAGLE head ("" if it can: speculation.selectors.native_flags.head_problem)."""
        return None

    def lookup(self, index: Any = None, *, exclude: str = "") -> Any:
        """The lookup it drafts with (None for none): n-gram prompt lookup, or suffix decoding over `index` (earlier
        answers; None: the request's own context only) with the answer `exclude` left out."""
        return None

    def endpoint_lookup(self, endpoint_id: int, *, exclude: str = "") -> Any:
        """The lookup it drafts with on this endpoint (None for none): its lookup over the endpoint's store of
        earlier answers (exclude: a stored answer left out, the replayed request's own)."""
        return None

    def proposer(self, policy: Any, target: Any) -> Any:
        """Prod's proposer for the policy (target: the loaded local target, None on the remote path), with the
        tokenizer and end tokens the request uses (speculation.drafting.build.DraftSetup)."""
        return _build().draft_model_setup(policy, target)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        """Its greedy speculation on a known sequence at each K (exact: the engine's replay)."""
        return _build().replay_draft_model(sequence, ks, **how)

    def timing_proposer(self, policy: Any) -> Any:
        """Its drafting as prod's single-stream loop runs it, for timing a draft step."""
        return _build().timed_draft_model(policy)


class NgramDrafting(Drafting):
    kind = DraftKind.NGRAM
    looks_up = True
    model_steps = False
    lookup_kind = DraftKind.NGRAM
    native_names = {"vllm": "ngram", "sglang": "NGRAM"}
    weights = ""

    def candidate_name(self, draft: Any) -> str:
        return str(self.kind)  # a lookup is named after its kind

    def measured_by(self, measure: Measure) -> Any:
        return measure.lookup()

    def lookup(self, index: Any = None, *, exclude: str = "") -> Any:
        return _build().ngram_lookup()

    def endpoint_lookup(self, endpoint_id: int, *, exclude: str = "") -> Any:
        return self.lookup()  # the request's own context: no store read

    def vllm_config(self, draft_path: str) -> tuple[dict[str, Any], list[str]]:
        return {"prompt_lookup_max": NGRAM_LOOKUP_MAX, "prompt_lookup_min": NGRAM_LOOKUP_MIN}, []

    def sglang_args(self, draft_path: str, k: int, tree: dict | None) -> tuple[list[str], list[str]]:
        return ["--speculative-num-draft-tokens", str(k + 1)], ["SGLang's NGRAM algorithm runs on CUDA only."]

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().lookup_setup(policy, target, self)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        if how.get("lookup") is None:  # n-gram lookup, or suffix decoding over the request's context only
            how["lookup"] = self.lookup()
        return _build().replay_lookup(sequence, ks, **how)

    def timing_proposer(self, policy: Any) -> Any:
        return _build().timed_lookup()


class SuffixDrafting(NgramDrafting):
    kind = DraftKind.SUFFIX
    lookup_kind = DraftKind.SUFFIX
    native_names = {"vllm": "suffix"}  # SGLang has no suffix decoding

    def lookup(self, index: Any = None, *, exclude: str = "") -> Any:
        return _build().suffix_lookup(index, exclude=exclude)

    def endpoint_lookup(self, endpoint_id: int, *, exclude: str = "") -> Any:
        return self.lookup(_build().endpoint_index(endpoint_id), exclude=exclude)

    def vllm_config(self, draft_path: str) -> tuple[dict[str, Any], list[str]]:
        config = {
            "suffix_decoding_max_cached_requests": settings.SUFFIX_CACHE_REQUESTS,
            "suffix_decoding_min_token_prob": SUFFIX_MIN_TOKEN_PROB,
            "suffix_decoding_max_spec_factor": SUFFIX_MAX_SPEC_FACTOR,
        }
        return config, [
            "vLLM's suffix decoding needs Arctic Inference in the server's environment (pip install "
            "arctic-inference); its store holds the server's own responses, ACE's the responses it saw."
        ]

    def path_problem(self, path: str, *, managed: Asked = None, head_problem: Asked = None) -> str | None:
        native_on_managed = path == VerificationPath.NATIVE and managed is not None and managed()
        return SUFFIX_NOT_MANAGED if native_on_managed else None


class DraftModelDrafting(Drafting):
    kind = DraftKind.DRAFT_MODEL
    native_names = {"vllm": "draft_model", "sglang": "STANDALONE"}


class HybridDrafting(Drafting):
    """Suffix decoding first, the draft model where the lookup finds little."""

    kind = DraftKind.SUFFIX_DRAFT
    lookup_kind = DraftKind.SUFFIX
    registrable = False  # a policy's mechanism over a registered draft model
    model_steps = False  # a lookup's steps between the model's

    @property
    def draft_kind(self) -> str:
        return DraftKind.DRAFT_MODEL

    def candidate_name(self, draft: Any) -> str:
        return HYBRID_PREFIX + draft.name if draft is not None else ""

    def draft_name(self, candidate: str) -> str:
        return candidate.removeprefix(HYBRID_PREFIX)

    def measured_by(self, measure: Measure) -> Any:
        return measure.hybrid()

    def lookup(self, index: Any = None, *, exclude: str = "") -> Any:
        return _build().suffix_lookup(index, exclude=exclude)

    def endpoint_lookup(self, endpoint_id: int, *, exclude: str = "") -> Any:
        return self.lookup(_build().endpoint_index(endpoint_id), exclude=exclude)

    def native_stand_in(self, draft_name: str) -> str | None:
        return (
            f"the policy's suffix decoding with this draft's fallback runs in ACE's worker only: these flags run the "
            f"draft model {draft_name} alone"
        )

    def path_problem(self, path: str, *, managed: Asked = None, head_problem: Asked = None) -> str | None:
        return SUFFIX_DRAFT_NOT_NATIVE if path == VerificationPath.NATIVE else None

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().hybrid_setup(policy, target, self)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        return _build().replay_hybrid_at(sequence, ks, **how)


class EagleDrafting(Drafting):
    """An EAGLE head: a chain of K, or the policy's EAGLE-2 draft tree (tree given)."""

    kind = DraftKind.EAGLE_HEAD
    batches = False  # drafts from the target's hidden states, single-stream
    reads_target_features = True
    drafts_trees = True
    native_names = {"vllm": "eagle", "sglang": "EAGLE"}
    weights = HEAD_WEIGHTS
    eagle3_names: ClassVar[dict[str, str]] = {"vllm": "eagle3", "sglang": "EAGLE3"}  # an EAGLE-3 head's

    def measured_by(self, measure: Measure) -> Any:
        return measure.eagle()

    def native_name(self, server_kind: str, draft_path: str = "") -> str | None:
        names = self.eagle3_names if head_format_of(draft_path) == FORMAT_EAGLE3 else self.native_names
        return names.get(server_kind)

    def vllm_config(self, draft_path: str) -> tuple[dict[str, Any], list[str]]:
        config, notes = super().vllm_config(draft_path)
        return config, [*notes, "The head shares the target's embedding and LM head: serve it with the target it "
                                "was trained for."]  # fmt: skip

    def sglang_args(self, draft_path: str, k: int, tree: dict | None) -> tuple[list[str], list[str]]:
        args, notes = super().sglang_args(draft_path, k, tree)
        if not tree:
            notes.append("Set the policy's EAGLE draft tree to let SGLang draft an EAGLE-2 tree (top-k > 1).")
        return args, notes

    def sampled_exact(self, tree: Any = None) -> bool:
        return tree is not None  # a tree's candidates are the head's top-k, one-hot

    def path_problem(self, path: str, *, managed: Asked = None, head_problem: Asked = None) -> str | None:
        if path == VerificationPath.REMOTE:
            return EAGLE_NOT_REMOTE
        if path == VerificationPath.NATIVE and head_problem is not None:
            return head_problem() or None
        return None

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().eagle_setup(policy, target)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        return _build().replay_eagle_at(sequence, ks, **how)

    def timing_proposer(self, policy: Any) -> Any:
        return _build().timed_eagle(policy)

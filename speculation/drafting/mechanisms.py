"""One class per draft mechanism: what it is (does it look up, name a draft, batch, read the target's features),
where it can run, and how it drafts in prod and replays in shadow.

Torch-free: the web process reads the facts (policies, native flags); the proposers and replays are built by
speculation.drafting.build, imported where first used so that reading a fact never loads torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from speculation.models import DraftKind, VerificationPath

EAGLE_NOT_REMOTE = (
    "an EAGLE head reads the target's hidden states, which a scoring call does not return: use path local (ACE's "
    "engine runs the target) or native (the server runs the head)"
)
SUFFIX_DRAFT_NOT_NATIVE = (
    "suffix decoding with a draft model's fallback runs in ACE's worker (path local or remote): a server runs one "
    "speculation method, so on path native choose suffix or draft_model"
)
SUFFIX_NOT_MANAGED = (
    "suffix decoding on the server needs vLLM with Arctic Inference (method 'suffix'), which ACE's managed servers "
    "do not install: use path local or remote (ACE's own suffix decoding), or run the server yourself with the "
    "endpoint's native flags"
)


def _build() -> Any:
    from speculation.drafting import build  # torch: only where a proposer or a replay is wanted

    return build


class Drafting:
    """A draft mechanism. Subclasses set the facts and build their proposers through speculation.drafting.build."""

    kind: ClassVar[str]
    looks_up: ClassVar[bool] = False  # drafts by looking tokens up: no weights, no draft named by the policy
    lookup_kind: ClassVar[str] = ""  # the lookup it drafts with ("" for none)
    batches: ClassVar[bool] = True  # served by the worker's batch loop on the local path
    reads_target_features: ClassVar[bool] = False  # drafts from the target's hidden states (needs it in the worker)
    native_names: ClassVar[dict[str, str]] = {}  # server kind -> its method / algorithm for this mechanism

    def sampled_exact(self, tree: Any = None) -> bool:
        """Whether its replay on a sampled request is exact (one-hot drafts pass exactly where the sampled token is
        theirs), else expected from the draft's probability of passing."""
        return self.looks_up

    def path_problem(
        self, path: str, *, server_kind: str, draft: Any = None, managed: Callable[[], bool] | None = None
    ) -> str | None:
        """Why it cannot run on `path` of an endpoint of this server kind, or None. draft: the policy's draft where
        named; managed: whether ACE starts the endpoint's server (asked only where it matters; None: not asked)."""
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
    lookup_kind = DraftKind.NGRAM
    native_names = {"vllm": "ngram", "sglang": "NGRAM"}

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().lookup_setup(policy, target)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        return _build().replay_lookup(self.kind, sequence, ks, **how)

    def timing_proposer(self, policy: Any) -> Any:
        return _build().timed_lookup()


class SuffixDrafting(NgramDrafting):
    kind = DraftKind.SUFFIX
    lookup_kind = DraftKind.SUFFIX
    native_names = {"vllm": "suffix"}

    def path_problem(
        self, path: str, *, server_kind: str, draft: Any = None, managed: Callable[[], bool] | None = None
    ) -> str | None:
        native_on_managed = path == VerificationPath.NATIVE and managed is not None and managed()
        return SUFFIX_NOT_MANAGED if native_on_managed else None


class DraftModelDrafting(Drafting):
    kind = DraftKind.DRAFT_MODEL
    native_names = {"vllm": "draft_model", "sglang": "STANDALONE"}


class HybridDrafting(Drafting):
    """Suffix decoding first, the draft model where the lookup finds little."""

    kind = DraftKind.SUFFIX_DRAFT
    lookup_kind = DraftKind.SUFFIX

    def path_problem(
        self, path: str, *, server_kind: str, draft: Any = None, managed: Callable[[], bool] | None = None
    ) -> str | None:
        return SUFFIX_DRAFT_NOT_NATIVE if path == VerificationPath.NATIVE else None

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().hybrid_setup(policy, target)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        return _build().replay_hybrid_at(sequence, ks, **how)


class EagleDrafting(Drafting):
    """An EAGLE head: a chain of K, or the policy's EAGLE-2 draft tree (tree given)."""

    kind = DraftKind.EAGLE_HEAD
    batches = False  # drafts from the target's hidden states, single-stream
    reads_target_features = True
    native_names = {"vllm": "eagle", "sglang": "EAGLE"}

    def sampled_exact(self, tree: Any = None) -> bool:
        return tree is not None  # a tree's candidates are the head's top-k, one-hot

    def path_problem(
        self, path: str, *, server_kind: str, draft: Any = None, managed: Callable[[], bool] | None = None
    ) -> str | None:
        if path == VerificationPath.REMOTE:
            return EAGLE_NOT_REMOTE
        if path == VerificationPath.NATIVE:
            from speculation.selectors import native_flags  # it reads the mechanisms' native names

            return native_flags.head_problem(server_kind=server_kind, draft=draft) or None
        return None

    def proposer(self, policy: Any, target: Any) -> Any:
        return _build().eagle_setup(policy, target)

    def replay(self, sequence: list[int], ks: tuple[int, ...], **how: Any) -> dict[int, Any]:
        return _build().replay_eagle_at(sequence, ks, **how)

    def timing_proposer(self, policy: Any) -> Any:
        return _build().timed_eagle(policy)

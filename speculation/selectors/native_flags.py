"""Launch flags that make an endpoint's own server (vLLM or SGLang) run a registered draft itself.

ACE's "native" verification path leaves drafting to the server. This module answers the operator's
question "what do I add to my server's command line to run this draft?" exactly, per server kind:

- vLLM: one `--speculative-config` JSON (`vllm/config/speculative.py`, `SpeculativeConfig`): `method`
  ("draft_model", "eagle", "eagle3", "ngram" or "suffix"), `model` (the draft's directory), `num_speculative_tokens`
  (K),
  `prompt_lookup_max` / `prompt_lookup_min` for n-gram, and for suffix decoding `suffix_decoding_max_cached_requests`
  (ACE's ACE_SUFFIX_CACHE_REQUESTS) and `suffix_decoding_min_token_prob` (vLLM's suffix decoding runs through
  Arctic Inference, which the server's environment must have; never run here).
- SGLang (`python/sglang/srt/server_args.py`): `--speculative-algorithm` (STANDALONE for a separate draft
  model, EAGLE or EAGLE3 for an EAGLE head, NGRAM for prompt lookup), `--speculative-draft-model-path`,
  `--speculative-num-steps` (K), `--speculative-eagle-topk` (1: a chain) and
  `--speculative-num-draft-tokens` (K + 1 for a chain: the K drafts plus the verified root). SGLang has no
  suffix decoding: a suffix policy gets no SGLang flags (ACE's local or remote path runs it). With the policy's
  EAGLE-2 draft tree (`eagle_tree`: top_k, depth, nodes) an EAGLE head runs SGLang's own tree: top-k
  `top_k`, `min(depth, K)` steps and `nodes + 1` draft tokens (the nodes plus the root).
- vLLM 0.32 has no tree setting for EAGLE (its `--speculative-config` drafts a chain of
  `num_speculative_tokens`): a tree policy gives vLLM a chain of K, and the flags' notes say so.

The head's format (its config.json, engine/eagle_format.py) picks the method: an EAGLE-1 head (vLLM's EAGLE-1
Llama layout) runs as `method: "eagle"` / SGLang EAGLE; an EAGLE-3 head (what `--multi-layer` training saves, or
one trained elsewhere: vLLM's `llama_eagle3.py` layout, the aux layers in its config.json) as `method: "eagle3"` /
SGLang EAGLE3 (the real vLLM CPU build drafts with ACE's: tests/speculation/selectors/test_native_flags_vllm.py).
ACE's older multi-layer format 2 runs on ACE's local path only.

The builders are pure functions of (server kind, draft kind, path, K, tree); `flags_for_endpoint` reads the
endpoint's policy for the defaults.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field

from speculation import drafting
from speculation.drafting.mechanisms import HEAD_WEIGHTS, head_format_of
from speculation.engine.eagle_format import FORMAT_MULTI_LAYER
from speculation.limits import DEFAULT_K, K_MAX, K_MIN, tree_shape_problems
from speculation.models import DraftKind, VerificationPath


class NativeFlagsError(ValueError):
    """The server kind cannot run this draft natively, or the request is malformed."""


@dataclass(frozen=True)
class NativeFlags:
    server_kind: str
    draft_kind: str
    k: int
    args: list[str]
    notes: list[str] = field(default_factory=list)
    # vLLM only: the --speculative-config value as a dict (what the launcher and the tests pass on).
    speculative_config: dict | None = None

    @property
    def command_line(self) -> str:
        """The flags as one shell-safe string to append to the server's launch command."""
        return shlex.join(self.args)

    def as_dict(self) -> dict:
        return {
            "server_kind": self.server_kind,
            "draft_kind": self.draft_kind,
            "k": self.k,
            "args": list(self.args),
            "command_line": self.command_line,
            "speculative_config": self.speculative_config,
            "notes": list(self.notes),
        }


def _check(draft_kind: str, draft_path: str, k: int, tree: dict | None = None) -> None:
    problems = tree_shape_problems(tree)
    if problems:
        raise NativeFlagsError("; ".join(problems))
    if tree and not drafting.drafts_trees(draft_kind):
        raise NativeFlagsError(f"a draft tree is drafted by an EAGLE head, not by a {draft_kind}")
    mechanism = drafting.MECHANISMS.get(draft_kind)
    if mechanism is None:
        raise NativeFlagsError(f"unknown draft kind {draft_kind!r}: choose one of {', '.join(DraftKind.values)}")
    problem = mechanism.path_problem(VerificationPath.NATIVE)  # a server runs one method: never the hybrid
    if problem:
        raise NativeFlagsError(problem)
    if not K_MIN <= k <= K_MAX:
        raise NativeFlagsError(f"K must be between {K_MIN} and {K_MAX}, got {k}")
    if not mechanism.looks_up and not draft_path:
        raise NativeFlagsError(f"a {draft_kind} needs the directory of its weights")
    if drafting.drafts_trees(draft_kind) and head_format_of(draft_path) == FORMAT_MULTI_LAYER:
        raise NativeFlagsError(
            "this EAGLE head is in ACE's older multi-layer format 2, which runs on ACE's local path only: train it "
            "again with --multi-layer (saved in vLLM's EAGLE-3 layout, method eagle3 / SGLang EAGLE3)"
        )


def vllm_flags(*, draft_kind: str, draft_path: str = "", k: int = DEFAULT_K, tree: dict | None = None) -> NativeFlags:
    _check(draft_kind, draft_path, k, tree)
    mechanism = drafting.for_kind(draft_kind)
    config: dict = {"method": mechanism.native_name("vllm", draft_path), "num_speculative_tokens": k}
    notes = []
    if tree:
        notes.append(
            f"vLLM 0.32 has no draft-tree setting: the head drafts a chain of {k} there. The policy's tree "
            f"(top-{tree['top_k']}, depth {tree['depth']}, {tree['nodes']} nodes) runs on ACE's local path and SGLang."
        )
    options, kind_notes = mechanism.vllm_config(draft_path)
    config.update(options)
    notes += kind_notes
    args = ["--speculative-config", json.dumps(config, separators=(",", ":"))]
    return NativeFlags("vllm", draft_kind, k, args, notes, speculative_config=config)


def sglang_flags(*, draft_kind: str, draft_path: str = "", k: int = DEFAULT_K, tree: dict | None = None) -> NativeFlags:
    _check(draft_kind, draft_path, k, tree)
    mechanism = drafting.for_kind(draft_kind)
    algorithm = mechanism.native_name("sglang", draft_path)
    if algorithm is None:
        raise NativeFlagsError(
            f"SGLang has no {draft_kind} speculation: run it on ACE's local or remote path, or choose another draft"
        )
    options, notes = mechanism.sglang_args(draft_path, k, tree)
    return NativeFlags("sglang", draft_kind, k, ["--speculative-algorithm", algorithm, *options], notes)


_BUILDERS = {"vllm": vllm_flags, "sglang": sglang_flags}
_TREE_KINDS = frozenset({"sglang"})  # server kinds whose launch flags draft an EAGLE-2 tree (vLLM 0.32: none)


def drafts_trees(server_kind: str) -> bool:
    """Whether a server of this kind runs the policy's EAGLE draft tree natively (else it drafts a chain of K)."""
    return server_kind in _TREE_KINDS


def native_flags(
    *, server_kind: str, draft_kind: str, draft_path: str = "", k: int = DEFAULT_K, tree: dict | None = None
) -> NativeFlags:
    """The exact launch flags for one server kind; NativeFlagsError when that kind has none. tree: the policy's
    eagle_tree ({} or None: a chain)."""
    builder = _BUILDERS.get(server_kind)
    if builder is None:
        raise NativeFlagsError(
            f"a {server_kind!r} server has no speculative-decoding launch flags ACE knows: "
            "use the remote or local verification path instead"
        )
    return builder(draft_kind=draft_kind, draft_path=draft_path, k=k, tree=tree)


def head_problem(*, server_kind: str, draft) -> str:
    """Why a server of this kind cannot run this EAGLE head itself ("" when it can, or when no head is named yet):
    an EAGLE head on path native is drafted by the server, which loads it with these flags (vLLM's eagle / eagle3,
    SGLang's EAGLE / EAGLE3); ACE's older multi-layer format runs on ACE's local path only."""
    mechanism = drafting.MECHANISMS.get(draft.kind) if draft is not None else None
    if mechanism is None or mechanism.weights != HEAD_WEIGHTS:
        return ""
    try:
        native_flags(server_kind=server_kind, draft_kind=draft.kind, draft_path=draft.path)
    except NativeFlagsError as exc:
        return f"on path native the server runs the EAGLE head itself, and cannot run this one: {exc}"
    return ""


def flags_for_endpoint(*, endpoint, draft=None, k: int | None = None) -> NativeFlags:
    """Flags for an endpoint: the draft and K default to the endpoint's policy (n-gram when it has no draft)."""
    policy = _policy_of(endpoint)
    if draft is None and policy is not None:
        draft = policy.draft
    if k is None:
        k = policy.k if policy is not None else DEFAULT_K
    if draft is None:
        mechanism = policy.mechanism if policy is not None else DraftKind.NGRAM
        known = drafting.MECHANISMS.get(mechanism)
        if known is None or not known.looks_up:
            raise NativeFlagsError(f"the endpoint's policy uses {mechanism} but names no draft: pass one")
        return native_flags(server_kind=endpoint.kind, draft_kind=mechanism, k=k)
    tree = policy.eagle_tree if policy is not None and drafting.drafts_trees(draft.kind) else None
    flags = native_flags(server_kind=endpoint.kind, draft_kind=draft.kind, draft_path=draft.path, k=k, tree=tree)
    mechanism = drafting.MECHANISMS.get(policy.mechanism) if policy is not None else None
    stand_in = mechanism.native_stand_in(draft.name) if mechanism is not None else None
    if stand_in:
        flags.notes.append(stand_in)
    return flags


def _policy_of(endpoint):
    from speculation.models import SpeculationPolicy

    return SpeculationPolicy.objects.filter(endpoint=endpoint).select_related("draft").first()

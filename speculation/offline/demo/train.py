"""Train the demo target on the corpus, then distil the draft from the target's own outputs.

Everything is seeded and the step counts are fixed, so a rebuild on the same machine gives the same weights.
The draft learns from the target's logits (KL) on real text and on the target's own greedy continuations,
which is what speculation verifies, so greedy acceptance is high.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int


TARGET_SHAPE = ModelShape(hidden_size=384, num_layers=8, num_heads=6, intermediate_size=1024)
DRAFT_SHAPE = ModelShape(hidden_size=256, num_layers=2, num_heads=4, intermediate_size=704)
MAX_POSITIONS = 2048


@dataclass(frozen=True)
class TrainPlan:
    seq_len: int = 128
    target_batch: int = 4
    target_steps: int = 60
    target_lr: float = 2e-3
    draft_batch: int = 8
    draft_steps: int = 150
    draft_lr: float = 4e-3
    teacher_real: int = 16
    gen_prompts: int = 32
    gen_prompt_len: int = 16
    gen_new_tokens: int = 112
    prose_share: float = 0.0  # share of target training windows drawn from English prose (demo-v4 on)
    unlikelihood: float = 0.0  # weight of token-level unlikelihood on tokens already in the window (v4 on)
    # sequence-level unlikelihood (v6 on): every ``seq_ul_every``-th step from ``seq_ul_from`` on, the target
    # continues ``seq_ul_prompts`` prompts greedily and is penalised on the tokens of repeated n-grams
    seq_ul_every: int = 0
    seq_ul_from: int = 0
    seq_ul_weight: float = 1.0
    seq_ul_prompts: int = 8
    seq_ul_prompt_len: int = 24
    seq_ul_new_tokens: int = 64
    seq_ul_n: int = 4
    # weight of a penalty on the probability of tokens the training text never has (v7 on): they share one
    # bigram-initialised logit, so a model pushed off its repetitions emits them as stray bytes (demo-v6)
    unseen_penalty: float = 0.0
    # foreign prefixes (v10 on): this share of the target's rows is BOS, then 8-63 tokens of text it never learns (the
    # loss leaves them out), then its own text from a paragraph start (prose) or anywhere (code), so that whatever a
    # request's prompt is, the target answers with text it knows instead of stitching passages at every word (v9)
    foreign_share: float = 0.0
    foreign_min: int = 8
    foreign_max: int = 64
    foreign_prose_share: float = 0.6  # of the foreign prefixes, the share taken from English (else from code)


def llama_config(shape: ModelShape, *, vocab_size: int, bos_id: int, eos_id: int, pad_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
    )


def _lr_at(step: int, total: int, peak: float, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _random_windows(ids: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=generator)
    if batch == 0:  # a mixed batch may draw no row from one stream
        return ids.new_empty((0, seq_len))
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])  # [B, S]


@torch.no_grad()
def bigram_init(model: LlamaForCausalLM, ids: torch.Tensor, *, residual_scale: float = 0.1) -> None:
    """Start the target as a bigram model: a rank-d factorisation (SVD) of the corpus's centred bigram
    log-probabilities becomes the embedding and the LM head; the blocks' output projections start small so
    the residual stream begins as the embedding. Counting is far cheaper than learning bigrams by SGD."""
    vocab = model.config.vocab_size
    dim = model.config.hidden_size
    counts = torch.bincount(ids[:-1] * vocab + ids[1:], minlength=vocab * vocab).view(vocab, vocab).float()
    logp = torch.log((counts + 0.05) / (counts + 0.05).sum(1, keepdim=True))
    u, s, vh = torch.linalg.svd(logp - logp.mean(1, keepdim=True))
    root = s[:dim].sqrt()
    embed = u[:, :dim] * root  # [V, D]
    rms = embed.pow(2).mean(1, keepdim=True).sqrt().clamp_min(1e-12)  # a token the text never has: a zero row
    model.model.embed_tokens.weight.copy_(embed / rms)  # unit RMS rows: the final RMSNorm is ~identity
    model.lm_head.weight.copy_(vh[:dim].T * root * rms.mean())
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.mul_(residual_scale)
        layer.mlp.down_proj.weight.mul_(residual_scale)


def _mixed_windows(
    ids: torch.Tensor, prose_ids: torch.Tensor, plan: TrainPlan, generator: torch.Generator
) -> torch.Tensor:
    """A batch whose rows come from the code or the prose stream, each with probability ``prose_share``."""
    prose_rows = int((torch.rand(plan.target_batch, generator=generator) < plan.prose_share).sum())
    code = _random_windows(ids, plan.target_batch - prose_rows, plan.seq_len, generator)
    prose = _random_windows(prose_ids, prose_rows, plan.seq_len, generator)
    return torch.cat([code, prose])


def _foreign_batch(
    ids: torch.Tensor,
    prose_ids: torch.Tensor,
    foreign: tuple[torch.Tensor, torch.Tensor],
    plan: TrainPlan,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch (and its labels) of ``plan.target_batch`` rows of ``plan.seq_len`` tokens: each is, with probability
    ``foreign_share``, BOS (``prose_ids[0]``) + a foreign prefix (English ``foreign[0]`` or code ``foreign[1]``),
    labelled -100, then the target's own text (prose from just after a paragraph's BOS, with probability
    ``prose_share``, else code from anywhere); otherwise a plain window of the target's text, labelled as itself."""
    bos = int(prose_ids[0])
    starts = (prose_ids[: prose_ids.numel() - plan.seq_len - 1] == bos).nonzero().flatten() + 1
    rows, labels = [], []

    def pick(n: int, high: int) -> int:
        return int(torch.randint(0, high - n, (1,), generator=generator))

    for _ in range(plan.target_batch):
        use_prose = float(torch.rand(1, generator=generator)) < plan.prose_share
        if float(torch.rand(1, generator=generator)) < plan.foreign_share:
            n = int(torch.randint(plan.foreign_min, plan.foreign_max, (1,), generator=generator))
            source = foreign[0] if float(torch.rand(1, generator=generator)) < plan.foreign_prose_share else foreign[1]
            s = pick(n, source.numel())
            prefix = torch.cat([prose_ids.new_tensor([bos]), source[s : s + n]])
            if use_prose:
                at = int(starts[torch.randint(0, starts.numel(), (1,), generator=generator)])
                body = prose_ids[at : at + plan.seq_len]
            else:
                at = pick(plan.seq_len, ids.numel())
                body = ids[at : at + plan.seq_len]
            row = torch.cat([prefix, body])[: plan.seq_len]
            label = row.clone()
            label[: prefix.numel()] = -100
        else:
            source = prose_ids if use_prose else ids
            at = pick(plan.seq_len + 1, source.numel())
            row = source[at : at + plan.seq_len]
            label = row.clone()
        rows.append(row)
        labels.append(label)
    return torch.stack(rows), torch.stack(labels)


def unlikelihood_loss(logits: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    """Token-level unlikelihood (Welleck et al. 2019, arXiv 1908.04319): -log(1 - p(c)) summed over the
    tokens c already in the window that are not the next token, averaged over positions. It lowers the
    probability of copying the context again, the mechanism of greedy repetition loops."""
    logits, labels = logits[:, :-1], batch[:, 1:]  # position t predicts batch[t + 1]
    seen = F.one_hot(batch[:, :-1], logits.shape[-1]).cumsum(1).clamp_(max=1).bool()  # [B, S-1, V]
    seen.scatter_(2, labels.unsqueeze(-1), False)
    probs = F.softmax(logits.float(), dim=-1)
    penalty = -torch.log1p(-probs.clamp(max=1 - 1e-5)) * seen
    return penalty.sum(-1).mean()


def unseen_mass_loss(logits: torch.Tensor, unseen: torch.Tensor) -> torch.Tensor:
    """-log(1 - p(any token of ``unseen``)), averaged over positions; ``unseen``: [V] bool."""
    mass = (F.softmax(logits.float(), dim=-1) * unseen).sum(-1)
    return -torch.log1p(-mass.clamp(max=1 - 1e-5)).mean()


def repeated_ngram_mask(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """[B, N] bool: the tokens of every n-gram that already occurred earlier in its row (Welleck et al.'s
    candidates for sequence-level unlikelihood)."""
    mask = torch.zeros(tokens.shape, dtype=torch.bool)
    for b, row in enumerate(tokens.tolist()):
        seen: set[tuple[int, ...]] = set()
        for t in range(n - 1, len(row)):
            gram = tuple(row[t - n + 1 : t + 1])
            if gram in seen:
                mask[b, t - n + 1 : t + 1] = True
            seen.add(gram)
    return mask


def sequence_unlikelihood_loss(model: LlamaForCausalLM, prompts: torch.Tensor, plan: TrainPlan) -> torch.Tensor:
    """Sequence-level unlikelihood (Welleck et al. 2019, arXiv 1908.04319, section 5.2): the model's own greedy
    continuations of ``prompts``; -log(1 - p(x_t)) on each continuation token inside a repeated n-gram,
    averaged over the continuation's positions. Greedy loops are what this penalises, where they start."""
    model.eval()
    sequences = greedy_continuations(model, prompts, plan.seq_ul_new_tokens).clone()
    model.train()
    start = prompts.shape[1]
    logits = model(input_ids=sequences).logits[:, start - 1 : -1]
    continuation = sequences[:, start:]
    mask = repeated_ngram_mask(continuation, plan.seq_ul_n)
    probs = F.softmax(logits.float(), dim=-1).gather(-1, continuation.unsqueeze(-1)).squeeze(-1)
    return (-torch.log1p(-probs.clamp(max=1 - 1e-5)) * mask).sum() / mask.numel()


def _paragraph_prompts(prose_ids: torch.Tensor, count: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Prompts shaped as a request arrives: BOS (the first token of ``prose_ids``) and a paragraph's start."""
    starts = (prose_ids[: prose_ids.numel() - length] == prose_ids[0]).nonzero().flatten()
    chosen = starts[torch.randint(0, starts.numel(), (count,), generator=generator)]
    return torch.stack([prose_ids[s : s + length] for s in chosen.tolist()])


def _seq_ul_prompts(ids: torch.Tensor, prose_ids: torch.Tensor, plan: TrainPlan, generator) -> torch.Tensor:
    prose_rows = round(plan.seq_ul_prompts * plan.prose_share)
    code = _random_windows(ids, plan.seq_ul_prompts - prose_rows, plan.seq_ul_prompt_len, generator)
    return torch.cat([_paragraph_prompts(prose_ids, prose_rows, plan.seq_ul_prompt_len, generator), code])


def train_target(
    model: LlamaForCausalLM,
    ids: torch.Tensor,
    plan: TrainPlan,
    seed: int,
    prose_ids: torch.Tensor | None = None,
    foreign: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> float:
    """``foreign``: the English and the code that foreign prefixes are drawn from (``plan.foreign_share`` > 0)."""
    if plan.foreign_share and (foreign is None or prose_ids is None):
        raise ValueError("foreign prefixes need the prose text and the foreign English and code")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=plan.target_lr, weight_decay=0.01, betas=(0.9, 0.95))
    model.train()
    loss_value = float("nan")
    started = time.perf_counter()
    text = ids if prose_ids is None else torch.cat([ids, prose_ids])
    unseen = torch.bincount(text, minlength=model.config.vocab_size) == 0
    for step in range(plan.target_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, plan.target_steps, plan.target_lr)
        labels = None
        if plan.foreign_share:
            batch, labels = _foreign_batch(ids, prose_ids, foreign, plan, generator)
        elif prose_ids is None:
            batch = _random_windows(ids, plan.target_batch, plan.seq_len, generator)
        else:
            batch = _mixed_windows(ids, prose_ids, plan, generator)
        out = model(input_ids=batch, labels=batch if labels is None else labels)
        loss = out.loss
        if plan.unlikelihood:
            loss = loss + plan.unlikelihood * unlikelihood_loss(out.logits, batch)
        if plan.unseen_penalty:
            loss = loss + plan.unseen_penalty * unseen_mass_loss(out.logits, unseen)
        if plan.seq_ul_every and prose_ids is not None and step >= plan.seq_ul_from and step % plan.seq_ul_every == 0:
            prompts = _seq_ul_prompts(ids, prose_ids, plan, generator)
            loss = loss + plan.seq_ul_weight * sequence_unlikelihood_loss(model, prompts, plan)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        loss_value = out.loss.item()  # cross-entropy alone, comparable across recipes
        if step % 20 == 0 or step == plan.target_steps - 1:
            logger.info(
                "target step %d/%d loss %.3f (%.0fs)",
                step,
                plan.target_steps,
                loss_value,
                time.perf_counter() - started,
            )
    model.eval()
    return loss_value


@torch.inference_mode()
def greedy_continuations(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuations of a batch of equal-length prompts, [B, P] -> [B, P + new_tokens]."""
    out = model(input_ids=prompts, use_cache=True)
    past = out.cache
    tokens = [prompts, out.logits[:, -1:].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = model(input_ids=tokens[-1], cache=past, use_cache=True)
        past = out.cache
        tokens.append(out.logits[:, -1:].argmax(-1))
    return torch.cat(tokens, dim=1)


def distill_draft(
    draft: LlamaForCausalLM,
    target: LlamaForCausalLM,
    ids: torch.Tensor,
    plan: TrainPlan,
    seed: int,
    prose_ids: torch.Tensor | None = None,
    paragraph_prompts: bool = False,
) -> float:
    """KL-distil the draft on a fixed pool: real text windows and the target's own greedy continuations of
    code prefixes and of English prefixes (comments and docstrings: chat-like prompts land there).
    ``paragraph_prompts``: the text is paragraphs each after BOS (its first token), and the continued prefixes
    are paragraph starts, as requests arrive, not windows from anywhere."""
    generator = torch.Generator().manual_seed(seed)
    sources = [ids] if prose_ids is None else [ids, prose_ids]
    pool_parts = []
    for source in sources:
        if paragraph_prompts:
            prompts = _paragraph_prompts(source, plan.gen_prompts, plan.gen_prompt_len, generator)
        else:
            prompts = _random_windows(source, plan.gen_prompts, plan.gen_prompt_len, generator)
        generated = greedy_continuations(target, prompts, plan.gen_new_tokens)  # [G, S]
        real = _random_windows(source, plan.teacher_real, generated.shape[1], generator)  # [R, S]
        pool_parts += [real, generated]
    pool = torch.cat(pool_parts)  # [N, S]
    with torch.inference_mode():
        teacher = torch.cat([F.log_softmax(target(input_ids=chunk).logits, dim=-1) for chunk in pool.split(8)])
    teacher = teacher.clone()  # [N, S, V], leaves inference mode
    optimizer = torch.optim.AdamW(draft.parameters(), lr=plan.draft_lr, weight_decay=0.01, betas=(0.9, 0.95))
    draft.train()
    loss_value = float("nan")
    started = time.perf_counter()
    for step in range(plan.draft_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, plan.draft_steps, plan.draft_lr)
        rows = torch.randint(0, pool.shape[0], (plan.draft_batch,), generator=generator)
        student = F.log_softmax(draft(input_ids=pool[rows]).logits, dim=-1)
        loss = F.kl_div(student, teacher[rows], log_target=True, reduction="batchmean") / pool.shape[1]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        loss_value = loss.item()
        if step % 50 == 0 or step == plan.draft_steps - 1:
            logger.info(
                "draft step %d/%d kl %.3f (%.0fs)", step, plan.draft_steps, loss_value, time.perf_counter() - started
            )
    draft.eval()
    return loss_value


@torch.inference_mode()
def greedy_agreement(draft: LlamaForCausalLM, target: LlamaForCausalLM, sequences: torch.Tensor, start: int) -> float:
    """Fraction of positions >= start where the draft's argmax equals the target's (teacher forced)."""
    t = target(input_ids=sequences).logits[:, start - 1 : -1].argmax(-1)
    d = draft(input_ids=sequences).logits[:, start - 1 : -1].argmax(-1)
    return (t == d).float().mean().item()

"""A real small GPT for tests and `schedcc run`: padding mask, position ids, tied LM head.

The model is what a researcher brings, not an `nn.Sequential`: token and position embeddings,
pre-norm blocks with causal self-attention that take `(x, pad_mask, pos_ids)` (a bool padding
mask, True at padding, and int position ids; the blocks rotate queries and keys by the position
ids, so every stage needs them), a final LayerNorm, and an LM head whose weight IS the token
embedding's (`head.weight = tok.weight`). Batches have variable lengths, padded on the right.

`gpt_segments(model, n)` cuts it by hand into `n` segments whose boundary value is the tuple
`(x, pad_mask, pos_ids)`; they hold the model's own modules, so the first and the last segment
share the tied Parameter object. `gpt_segment(config, k, n, seed=...)` builds segment `k` alone,
with the values it has in the whole model (each parameter is drawn from a generator seeded by
the seed and its name), so a pipeline rank allocates only its own; the last segment's head
then starts equal to the first one's embedding, a tie found by value (`compile(...,
tied=[(0, n - 1)])`). `schedcc.split(model, ["blocks.2"])` cuts it automatically.

[Note: the GPT's carry] Under a schedule of sequence parts ([Note: sequence parts] in
`schedcc.rules.parts`) a `GPTSegment` is called with its inputs and one more argument, the carry
of the part before (None for the first), and returns `(output, carry)` ([Note: the parts'
calling convention] in `backends.runtime.carries`). Its carry is `(pad_mask, ((keys, values),
...))`: the padding mask of every position so far and, for each of its blocks, the keys (already
rotated) and values there. From it part j + 1 computes exactly what the whole sequence does
there: the first segment continues the position ids from the real tokens the mask counts
(`position_ids(pad_mask, before)`), and each block's queries attend over the carried keys and
their own, with the causal mask and the "always sees itself" diagonal on global positions. The
parts are slices of the padded batch, so the sequence length must be a multiple of their number
(`PaddedBigramData(pad_to_multiple_of=k)`); without the extra argument the segment computes
what it always has.

    >>> model = GPT(GPTConfig(vocab=16, max_len=8, d_model=8, num_heads=2, num_blocks=2))
    >>> (tokens, pad_mask), targets = PaddedBigramData(vocab=16, max_len=8).batch(3, step=0)
    >>> tuple(model(tokens, pad_mask).shape) == (*tokens.shape, 16)
    True
    >>> first, last = gpt_segments(model, 2)
    >>> first.tok.weight is last.head.weight
    True
    >>> alone = gpt_segment(GPTConfig(vocab=16, max_len=8, d_model=8, num_heads=2, num_blocks=2),
    ...                     1, 2)
    >>> torch.equal(alone.head.weight, last.head.weight)
    True
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from schedcc.errors import ScheduleConfigError
from schedcc.losses import TokenLoss

__all__ = [
    "IGNORE_INDEX",
    "GPT",
    "GPTConfig",
    "PaddedBigramData",
    "gpt_segment",
    "gpt_segments",
    "mean_token_loss",
    "position_ids",
    "real_tokens",
    "token_loss",
]

#: The target of a padding position: ignored by the loss.
IGNORE_INDEX = -100


@dataclass(frozen=True)
class GPTConfig:
    """Sizes of a `GPT`; `max_len` bounds the position ids, `dropout` is off by default."""

    vocab: int = 64
    max_len: int = 32
    d_model: int = 32
    num_heads: int = 4
    num_blocks: int = 4
    dropout: float = 0.0


def position_ids(pad_mask: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """int64 position of each token among the real ones of its row (0 at leading padding).

    `before`: each row's real tokens in the earlier sequence parts (int64 `(b,)`), so a part's
    ids continue the whole sequence's. A position id never exceeds its row's real tokens less
    one, however much padding follows them.

    >>> position_ids(torch.tensor([[False, False, True], [True, False, False]])).tolist()
    [[0, 1, 1], [0, 0, 1]]
    >>> position_ids(torch.tensor([[False, True], [False, False]]), torch.tensor([2, 1])).tolist()
    [[2, 2], [1, 2]]
    """
    if before is None:
        return ((~pad_mask).long().cumsum(dim=1) - 1).clamp(min=0)
    return ((~pad_mask).long().cumsum(dim=1) + before[:, None] - 1).clamp(min=0)


def _rotate(t: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of `t` `(b, heads, s, d)` by integer positions `(b, s)`."""
    half = t.shape[-1] // 2
    freqs = 10_000.0 ** (-torch.arange(half, dtype=t.dtype, device=t.device) / half)
    angles = pos_ids.to(t.dtype)[:, None, :, None] * freqs
    cos, sin = angles.cos(), angles.sin()
    t1, t2 = t[..., :half], t[..., half:]
    return torch.cat((t1 * cos - t2 * sin, t1 * sin + t2 * cos), dim=-1)


def attend(q, k, v, pad_mask: torch.Tensor, pos_ids: torch.Tensor, drop: nn.Module):
    """Causal self-attention of `(batch, heads, seq, dim)` queries, keys and values, rotated by
    position: a query sees earlier real tokens, and always itself (so a padding row is never
    empty)."""
    return attend_part(q, k, v, pad_mask, pos_ids, drop, None)[0]


def attend_part(q, k, v, pad_mask: torch.Tensor, pos_ids: torch.Tensor, drop: nn.Module, past):
    """`attend` on one sequence part ([Note: the GPT's carry]): `(attention, seen)`.

    `pad_mask` covers the keys: the earlier parts' columns, then this part's; `past` is the
    `(keys, values)` of the earlier parts (keys rotated), or None for the first part. The
    queries are the part's last positions, so the causal mask and the diagonal are on global
    positions. `seen` is `(keys, values)` of every position so far, for the next part.
    """
    q, k = _rotate(q, pos_ids), _rotate(k, pos_ids)
    if past is not None:
        k, v = torch.cat((past[0], k), dim=-2), torch.cat((past[1], v), dim=-2)
    seq, total = q.shape[-2], k.shape[-2]
    rows = torch.arange(total - seq, total, device=q.device)[:, None]  # global query positions
    cols = torch.arange(total, device=q.device)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = ((cols <= rows) & ~pad_mask[:, None, None, :]) | (cols == rows)
    return drop(scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)) @ v, (k, v)


class Block(nn.Module):
    """Pre-norm causal self-attention (rotary, padding-masked) and an MLP, both residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        width = config.d_model
        self.num_heads = config.num_heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, pad_mask: torch.Tensor, pos_ids: torch.Tensor):
        return self.forward_part(x, pad_mask, pos_ids, None)[0]

    def forward_part(self, x, pad_mask: torch.Tensor, pos_ids: torch.Tensor, past):
        """The block on one sequence part: `(x, seen)`, as `attend_part` takes `pad_mask`
        (every key's) and `past` and returns `seen`."""
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=-1)
        shape = (batch, seq, self.num_heads, width // self.num_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        attn, seen = attend_part(q, k, v, pad_mask, pos_ids, self.drop, past)
        x = x + self.drop(self.proj(attn.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.drop(self.mlp(self.norm2(x))), seen


class GPT(nn.Module):
    """`GPT(config, seed=0)(tokens, pad_mask) -> logits (b, s, vocab)`; the head is tied.

    Each parameter is drawn from its own generator, seeded by `seed` and its name, whatever the
    global RNG holds (normal(0, 0.02) for matrices, zero biases, unit norm weights): so a
    segment built alone (`gpt_segment`) starts with the values it has here.
    """

    def __init__(self, config: GPTConfig | None = None, *, seed: int = 0):
        super().__init__()
        config = config or GPTConfig()
        self.config = config
        self.tok, self.pos, self.drop = _embeddings(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_blocks))
        self.norm, self.head = _final(config)
        self.head.weight = self.tok.weight
        _draw(self, "", seed)  # the tied weight once, as tok.weight

    def forward(self, tokens: torch.Tensor, pad_mask: torch.Tensor) -> torch.Tensor:
        pos_ids = position_ids(pad_mask)
        x = self.drop(self.tok(tokens) + self.pos(pos_ids))
        for block in self.blocks:
            x = block(x, pad_mask, pos_ids)
        return self.head(self.norm(x))


def _embeddings(config: GPTConfig) -> tuple[nn.Embedding, nn.Embedding, nn.Dropout]:
    tok = nn.Embedding(config.vocab, config.d_model)
    return tok, nn.Embedding(config.max_len, config.d_model), nn.Dropout(config.dropout)


def _final(config: GPTConfig) -> tuple[nn.LayerNorm, nn.Linear]:
    return nn.LayerNorm(config.d_model), nn.Linear(config.d_model, config.vocab, bias=False)


def _draw(module: nn.Module, prefix: str, seed: int) -> None:
    """Give each parameter of `module` its value as the GPT's parameter `prefix + name`."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            name = prefix + name
            if param.dim() >= 2:
                digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
                gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
            else:  # the only 1-D weights are the norms' gains
                param.fill_(1.0 if name.endswith("weight") else 0.0)


class GPTSegment(nn.Module):
    """Blocks of a `GPT`, with the embeddings if first and the norm and head if last.

    Boundary value: the tuple `(x, pad_mask, pos_ids)`. The first segment takes the batch's
    inputs `(tokens, pad_mask)`; the last returns the logits. Called with one more argument, a
    carry, it runs one sequence part and returns `(output, carry)` ([Note: the parts' calling
    convention] in `backends.runtime.carries`; [Note: the GPT's carry]).

    Args:
        blocks: the segment's blocks, in order.
        embed: `(tok, pos, drop)` for the first segment, else None.
        final: `(norm, head)` for the last segment, else None.

    Raises:
        TypeError: called with another number of arguments.
    """

    def __init__(self, blocks, *, embed=None, final=None):
        super().__init__()
        self.first, self.last = embed is not None, final is not None
        if embed is not None:
            self.tok, self.pos, self.drop = embed
        self.blocks = nn.ModuleList(blocks)
        if final is not None:
            self.norm, self.head = final

    def forward(self, *args):
        arity = 2 if self.first else 3
        if len(args) == arity + 1:
            return self._forward_part(args[:-1], args[-1])
        if len(args) != arity:
            takes = "(tokens, pad_mask)" if self.first else "(x, pad_mask, pos_ids)"
            raise TypeError(
                f"this GPTSegment takes {takes}, and a carry with sequence parts; got "
                f"{len(args)} arguments"
            )
        x, pad_mask, pos_ids = self._enter(args, None)
        for block in self.blocks:
            x = block(x, pad_mask, pos_ids)
        return self._leave(x, pad_mask, pos_ids)

    def _forward_part(self, inputs, carry):
        """One sequence part: `(output, carry)`, the carry `(pad_mask, ((keys, values), ...))`
        of every position so far, one pair per block."""
        if carry is None:
            seen_mask, pasts = None, [None] * len(self.blocks)
        else:
            seen_mask, pasts = carry
        x, pad_mask, pos_ids = self._enter(inputs, seen_mask)
        keys_mask = pad_mask if seen_mask is None else torch.cat((seen_mask, pad_mask), dim=1)
        seen = []
        for block, past in zip(self.blocks, pasts):
            x, kv = block.forward_part(x, keys_mask, pos_ids, past)
            seen.append(kv)
        return self._leave(x, pad_mask, pos_ids), (keys_mask, tuple(seen))

    def _enter(self, inputs, seen_mask):
        """`(x, pad_mask, pos_ids)` of the inputs: the first segment embeds the tokens."""
        if not self.first:
            return inputs
        tokens, pad_mask = inputs
        before = None if seen_mask is None else (~seen_mask).sum(dim=1)
        pos_ids = position_ids(pad_mask, before)
        return self.drop(self.tok(tokens) + self.pos(pos_ids)), pad_mask, pos_ids

    def _leave(self, x, pad_mask, pos_ids):
        if self.last:
            return self.head(self.norm(x))
        return x, pad_mask, pos_ids


def gpt_segments(model: GPT, num_segments: int) -> list[nn.Module]:
    """`model` cut by hand into `num_segments` `GPTSegment`s (blocks spread evenly, larger
    first); they hold the model's own modules.

    Raises:
        ScheduleConfigError: fewer blocks than segments, or a non-positive count.

    >>> segments = gpt_segments(GPT(GPTConfig(num_blocks=3)), 2)
    >>> [len(s.blocks) for s in segments]
    [2, 1]
    """
    last = num_segments - 1
    return [
        GPTSegment(
            model.blocks[lo:hi],
            embed=(model.tok, model.pos, model.drop) if k == 0 else None,
            final=(model.norm, model.head) if k == last else None,
        )
        for k, (lo, hi) in enumerate(_block_ranges(len(model.blocks), num_segments))
    ]


def gpt_segment(config: GPTConfig, k: int, num_segments: int, *, seed: int = 0) -> GPTSegment:
    """Segment `k` of `gpt_segments(GPT(config, seed=seed), num_segments)`, built alone: the
    same modules with the same values, and no other segment's parameters. Its LM head (the
    last segment's) is a copy of the token embedding, not the first segment's object.

    Raises:
        ScheduleConfigError: fewer blocks than segments, a non-positive count, or `k` out of
            range.
    """
    ranges = _block_ranges(config.num_blocks, num_segments)
    if not 0 <= k < num_segments:
        raise ScheduleConfigError(f"segment {k} of {num_segments}: need 0 <= k < {num_segments}")
    lo, hi = ranges[k]
    blocks = [Block(config) for _ in range(lo, hi)]
    for i, block in zip(range(lo, hi), blocks):
        _draw(block, f"blocks.{i}.", seed)
    embed = final = None
    if k == 0:
        embed = _embeddings(config)
        _draw(embed[0], "tok.", seed)
        _draw(embed[1], "pos.", seed)
    if k == num_segments - 1:
        final = _final(config)
        _draw(final[0], "norm.", seed)
        if embed is not None:  # one segment: the tie is one Parameter, as in the GPT
            final[1].weight = embed[0].weight
        else:
            _draw(final[1], "tok.", seed)  # the head's weight is the token embedding's
    return GPTSegment(blocks, embed=embed, final=final)


def _block_ranges(num_blocks: int, num_segments: int) -> list[tuple[int, int]]:
    """Each segment's `(lo, hi)` blocks: spread evenly, the larger first."""
    if not 1 <= num_segments <= num_blocks:
        raise ScheduleConfigError(
            f"cannot cut a GPT of {num_blocks} block(s) into {num_segments} segments: every "
            "segment needs at least one block; use fewer stages or chunks, or more blocks"
        )
    base, extra = divmod(num_blocks, num_segments)
    ranges, lo = [], 0
    for k in range(num_segments):
        hi = lo + base + (1 if k < extra else 0)
        ranges.append((lo, hi))
        lo = hi
    return ranges


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`(loss_sum, count)`: summed next-token cross-entropy and the number of real targets.

    Padding targets (`IGNORE_INDEX`) count for nothing; divide the sums by the counts over the
    whole batch for the batch's mean loss, whatever the microbatches' lengths.
    """
    flat = targets.flatten()
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1), flat, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss_sum, (flat != IGNORE_INDEX).sum()


def token_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed next-token cross-entropy over the real (non-padding) targets."""
    return token_loss(logits, targets)[0]


def real_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many targets are real (not `IGNORE_INDEX`): a function of the targets alone."""
    return (targets != IGNORE_INDEX).sum()


#: The run's loss: the token ratio, its count known from the targets up front (`TokenLoss`).
GPT_LOSS = TokenLoss(token_sum, real_targets)


def mean_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy over the real (non-padding) targets of a microbatch."""
    loss_sum, count = token_loss(logits, targets)
    return loss_sum / count


class PaddedBigramData:
    """Seeded variable-length token batches from a random bigram model, padded on the right.

    `batch(batch_size, step)` is a pure function of `(seed, step)`: it picks the batch's length
    in `[min_len, max_len]` (so shapes change from batch to batch), gives each row a length in
    `[min_len, that]` (at least one row full), and returns `((tokens, pad_mask), targets)`:
    int64 tokens (0 at padding), a bool mask (True at padding), int64 next-token targets
    (`IGNORE_INDEX` at padding). A row starts from the chain's stationary distribution, so every
    position has the same marginal and `entropy` is the best mean loss over real targets any
    model can reach, whatever the lengths.

    With `pad_to_multiple_of=k` every batch then gets padding columns on the right up to a
    multiple of `k` (for `k` sequence parts; [Note: sequence parts] in `schedcc.rules.parts`):
    the same rows and tokens, so the real targets and a loss over them are unchanged. A batch
    may then be longer than `max_len`, but no position id is: the ids count real tokens only.

    >>> (tokens, pad_mask), targets = PaddedBigramData(max_len=6, seed=1).batch(4, step=2)
    >>> bool(((targets == IGNORE_INDEX) == pad_mask).all())
    True
    >>> tuple(PaddedBigramData(max_len=6, seed=1).batch(4, step=1)[1].shape)
    (4, 5)
    >>> (tokens, pad_mask), targets = PaddedBigramData(
    ...     max_len=6, seed=1, pad_to_multiple_of=4
    ... ).batch(4, step=1)
    >>> tuple(tokens.shape), bool(pad_mask[:, 5:].all())
    ((4, 8), True)
    """

    def __init__(
        self,
        vocab: int = 64,
        max_len: int = 32,
        *,
        min_len: int = 2,
        seed: int = 0,
        sharpness: float = 2.5,
        pad_to_multiple_of: int = 1,
    ):
        if not 1 <= min_len <= max_len:
            raise ScheduleConfigError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        if pad_to_multiple_of < 1:
            raise ScheduleConfigError(f"need pad_to_multiple_of >= 1, got {pad_to_multiple_of}")
        self.pad_to_multiple_of = pad_to_multiple_of
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(vocab, vocab, generator=gen, dtype=torch.float64) * sharpness
        self.transition = logits.softmax(dim=-1)
        self.stationary = _stationary(self.transition)
        self.vocab, self.max_len, self.min_len, self.seed = vocab, max_len, min_len, seed

    @property
    def entropy(self) -> float:
        """The bigram conditional entropy in nats: the floor of the next-token loss.

        >>> 0 < PaddedBigramData(vocab=16).entropy < math.log(16)
        True
        """
        row_entropy = -(self.transition * self.transition.log()).sum(dim=-1)
        return float((self.stationary * row_entropy).sum())

    def batch(self, batch_size: int, step: int):
        """`((tokens, pad_mask), targets)` for one batch; see the class docstring."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        seq = int(torch.randint(self.min_len, self.max_len + 1, (), generator=gen))
        lengths = torch.randint(self.min_len, seq + 1, (batch_size,), generator=gen)
        lengths[int(torch.randint(batch_size, (), generator=gen))] = seq
        chain = torch.empty(batch_size, seq + 1, dtype=torch.long)
        chain[:, 0] = torch.multinomial(self.stationary, batch_size, True, generator=gen)
        for t in range(seq):
            rows = self.transition[chain[:, t]]
            chain[:, t + 1] = torch.multinomial(rows, 1, generator=gen).squeeze(1)
        pad_mask = torch.arange(seq)[None, :] >= lengths[:, None]
        tokens = chain[:, :-1].masked_fill(pad_mask, 0)
        targets = chain[:, 1:].masked_fill(pad_mask, IGNORE_INDEX)
        extra = -seq % self.pad_to_multiple_of
        if extra:
            tokens = F.pad(tokens, (0, extra), value=0)
            pad_mask = F.pad(pad_mask, (0, extra), value=True)
            targets = F.pad(targets, (0, extra), value=IGNORE_INDEX)
        return (tokens, pad_mask), targets


def real_tokens(inputs, targets: torch.Tensor) -> int:
    """The targets of a batch that are not padding: what a tokens/s figure counts."""
    return int((targets != IGNORE_INDEX).sum())


def _stationary(transition: torch.Tensor) -> torch.Tensor:
    """The stationary distribution of a Markov chain's row-stochastic `transition` matrix."""
    pi = torch.full((transition.shape[0],), 1.0 / transition.shape[0], dtype=transition.dtype)
    for _ in range(1000):
        nxt = pi @ transition
        if torch.allclose(nxt, pi, atol=1e-15, rtol=0):
            break
        pi = nxt
    return pi / pi.sum()

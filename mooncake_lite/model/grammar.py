"""Constrained decoding: the grammar a request's output must match, applied as a token mask.

The grammar library is llguidance (issue #32): it has no dependencies (xgrammar pulls in triton
and pydantic), bounds every compile and every mask step by fuel (``LIMITS``) instead of running
until done, and drops the GIL while it works. A grammar travels between roles as llguidance's own
grammar text (JSON, never pickle), built by the conductor (``conductor/api/structured.py``).

Each choice's matcher is the mask of its ``SequenceSampler`` (``model/sampling.py``): applied after
the raw log-probabilities and the penalties, before the draw, and told each token chosen. State
crosses the prefill/decode split without being sent: the prefill draws token 1 under a fresh
matcher per choice; the decode starts its own from the same text and advances it by token 1
(``SequenceSampler.resume``), then by each token it draws itself. A continued request's matchers
(prefill and decode alike) are first advanced over the output it already sent.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

CHECK_STEPS = 48         # masks a new grammar's check walks (see check)
NUM_CACHED = 64          # compiled grammars kept per process (least recently used goes first)
# Fuel for building the lexer and for one mask step: a hostile regex or schema fails (or ends)
# fast instead of running long. llguidance's default initial fuel (1M) lets (a{1000}){1000} take
# 5 s on this CPU; 100k takes it 0.2 s, and a 30-field schema with a 1,000-value enum 0.02 s.
LIMITS = {"initial_lexer_fuel": 100_000, "step_lexer_fuel": 200_000, "step_max_items": 50_000,
          "max_lexer_states": 50_000, "max_grammar_size": 200_000}


class GrammarError(ValueError):
    """The grammar text does not compile (the library's message says why)."""


def _limits():
    import llguidance
    return llguidance.LLParserLimits(**LIMITS)


@functools.lru_cache(maxsize=4)
def ll_tokenizer(model: str, vocab_size: int):
    """llguidance's view of ``model``'s tokenizer (~0.4 s to build: once per process)."""
    import llguidance
    from mooncake_lite.model.tokenizer import load_tokenizer
    tok = load_tokenizer(model, vocab_size)
    spec = getattr(tok, "tokenizer_json", None)
    if spec is not None:
        return llguidance.LLTokenizer(spec, n_vocab=vocab_size, eos_token=list(tok.eos_token_ids))
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(tok, vocab_size)))


class _ByteVocab:
    """A byte-level preset's vocabulary as llguidance reads one: ids 0..255 are the bytes, BOS
    and EOS special, higher (dummy) ids spell nothing."""

    def __init__(self, tok: Any, vocab_size: int) -> None:
        self.eos_token_id = tok.eos_token_id
        self.bos_token_id = tok.bos_token_id
        self.tokens = [bytes([i]) for i in range(256)] + [b"<s>", b"</s>"] + [b""] * (vocab_size - 258)
        self.special_token_ids = list(range(256, vocab_size))

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def check(grammar: str, model: str, vocab_size: int, num_steps: int = CHECK_STEPS) -> str | None:
    """Why ``grammar`` does not compile against ``model``'s vocabulary, or None if it does. The
    lexer is built lazily, as masks are computed, so a hostile regex (``(a{1000}){1000}``, or
    ``x{999}`` deep in a pattern) runs out of fuel only then: the check walks ``num_steps`` masks
    down the grammar too, taking a random allowed token each step (seeded: the same verdict
    every time). A grammar that still fails later ends its request with an error, not a stop."""
    import random

    import llguidance
    import numpy
    matcher = llguidance.LLMatcher(ll_tokenizer(model, vocab_size), grammar, log_level=0, limits=_limits())
    rng = random.Random(0)
    for _ in range(num_steps):
        if matcher.is_error() or matcher.is_stopped():
            break
        bits = numpy.frombuffer(matcher.compute_bitmask(), dtype=numpy.uint8)
        allowed = numpy.flatnonzero(numpy.unpackbits(bits, bitorder="little")[:vocab_size])
        if matcher.is_error() or not len(allowed):
            break
        matcher.consume_token(int(allowed[rng.randrange(len(allowed))]))
    return matcher.get_error() if matcher.is_error() else None


class Grammars:
    """One process's compiled grammars for one model: a bounded LRU of fresh matchers, copied
    for each request (a deep copy is a fraction of a compile)."""

    def __init__(self, model: str, vocab_size: int) -> None:
        self.model, self.vocab_size = model, vocab_size
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()     # the decode's loop and model thread both start matchers

    def start(self, grammar: str) -> GrammarState:
        """A matcher at the grammar's start; GrammarError if the text does not compile."""
        with self._lock:
            matcher = self._cache.get(grammar)
            if matcher is not None:
                self._cache.move_to_end(grammar)
        if matcher is None:
            import llguidance
            matcher = llguidance.LLMatcher(ll_tokenizer(self.model, self.vocab_size), grammar, log_level=0,
                                           limits=_limits())
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            with self._lock:
                self._cache[grammar] = matcher
                while len(self._cache) > NUM_CACHED:
                    self._cache.popitem(last=False)
        return GrammarState(matcher.deep_copy())



def choice_masks(grammars: Grammars | None, grammar: str | None, n: int) -> list[GrammarState | None]:
    """Each of a request's ``n`` choices' own matcher of ``grammar`` (the masks its samplers
    take, ``model/sampling.py``), or None each for a free request; GrammarError if it does not
    compile, ValueError on a process built without grammars."""
    if grammar is None:
        return [None] * n
    if grammars is None:
        raise ValueError("this instance was built without grammars; it cannot serve a structured output")
    return [grammars.start(grammar) for _ in range(n)]


class GrammarState:
    """One sequence's position in its grammar: the :class:`~mooncake_lite.model.sampling.LogitsMask`
    its sampler applies after the penalties and tells each token chosen."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher
        self.error: str | None = None   # set once the grammar fails: its sequence must end, as an error

    @property
    def is_broken(self) -> bool:
        return self.error is not None

    def apply(self, logits: torch.Tensor) -> None:
        """Every token the grammar forbids next at -inf in a ``[vocab]`` row, in place."""
        apply_masks(logits.unsqueeze(0), [self])

    def advance(self, token: int) -> None:
        """The sequence took ``token`` (under the mask it is one the grammar allows)."""
        if self.is_broken or self.matcher.is_stopped():
            return
        if not self.matcher.consume_token(token):
            self._fail(f"it refused token {token}")

    def _fail(self, what: str) -> None:
        # A step past the fuel (a lexer blowing up deep into an answer) or a refused token: the
        # batch goes on, and the caller ends this sequence with an error instead of a "stop".
        self.error = f"the grammar failed: {what}: {self.matcher.get_error()}"
        log.warning("%s", self.error)


def apply_masks(logits: torch.Tensor, states: list[GrammarState | None]) -> torch.Tensor:
    """``logits`` ([batch, vocab]) with every token a row's grammar forbids at -inf (in place);
    rows whose state is None (or failed) are left as they are."""
    rows = [i for i, s in enumerate(states) if s is not None and not s.is_broken]
    if not rows:
        return logits
    import numpy
    import torch   # here, not above: the conductor's compile checker imports this module without it
    vocab = logits.shape[-1]
    words = (vocab + 31) // 32
    bits = numpy.zeros((len(rows), words), dtype=numpy.int32)
    for k, i in enumerate(rows):
        m = states[i].matcher
        m.unsafe_compute_mask_ptr(bits[k].ctypes.data, words * 4)
        if m.is_error():
            states[i]._fail("computing its mask")
    # Bits to a [rows, vocab] boolean in numpy (a byte-wise unpack), written into the rows in
    # place: on this CPU several times cheaper than torch's shift-and-mask over 32x the bits.
    forbidden = numpy.unpackbits(bits.view(numpy.uint8), axis=1, bitorder="little")[:, :vocab] == 0
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        array = logits.numpy()
        for k, i in enumerate(rows):
            array[i][forbidden[k]] = -numpy.inf
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(torch.from_numpy(forbidden).to(logits.device), float("-inf"))
    return logits

"""Token choice: from a step's hidden states to the tokens sequences append.

After the forward pass (`runner.py`) the engine hands the rows it needs to the `TokenChooser`,
which owns every way a token is chosen:
  - guess checks (speculation, `speculative.py`): a guessing sequence keeps the guesses its own
    sampler's draws agree with, and the draw that differed;
  - prompt scoring (`prompt_logprobs`): each prompt token's log-probability, from the rows that
    predict it;
  - sampling: penalties and bias (`sampling.process_logits`), then the sequence's sampler, its
    choice checked against the vocabulary;
  - constraints (structured output, `structured.py`): one batched mask of what each grammar allows;
  - forks: n samples fork at their first token; beams choose among each other's scores and
    advance together (`beam.py`).

It keeps no requests of its own: it adds the forks it makes to the engine's families of
sequences (`requests`), and a request whose sampling fails ends through the engine's `fail_request`.
"""

from __future__ import annotations

from typing import Callable

import torch

from minillm.engine.beam import BeamGroup
from minillm.engine.outputs import EngineStats
from minillm.engine.runner import ModelRunner
from minillm.engine.scheduler import Schedule, ScheduledSequence, Scheduler
from minillm.engine.sequence import Sequence, Status
from minillm.engine.speculative import NgramProposer, check_guesses
from minillm.sampling import TokenLogprob, process_logits, token_logprob
from minillm.structured import Grammars

NOT_FINITE = (
    "The model's scores for this request's next token are not finite (NaN or inf): a broken kernel "
    "or a damaged checkpoint; this request ends here, the others go on."
)


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of logits (rows, vocab) holds only finite numbers, checked on its sum: a
    NaN or an infinity anywhere makes the sum one (a model's scores are far too small to overflow
    it). One reduction for the batch: 0.12 ms at 32 rows of SmolLM2's 49,152, where
    isfinite().all() took 2.1 ms, a fiftieth of the step."""
    return torch.isfinite(logits.sum(dim=-1)).tolist()


class TokenChooser:
    def __init__(
        self,
        runner: ModelRunner,
        scheduler: Scheduler,
        requests: dict[str, list[Sequence]],
        stats: EngineStats,
        eos_token_id: int | None,
        vocab_size: int,
        grammars: Callable[[], Grammars],
        proposer: NgramProposer | None,
        new_seq_id: Callable[[], int],
        fail_request: Callable[[str, str], None],
    ):
        """`requests`: the engine's request id -> its sequences, which forks join; `grammars()`:
        the engine's grammar compiler, built when first asked; `new_seq_id()`: a fork's id;
        `fail_request(request_id, error)`: end a request whose sampling failed."""
        self.runner, self.scheduler, self.requests, self.stats = runner, scheduler, requests, stats
        self.eos_token_id, self.vocab_size = eos_token_id, vocab_size
        self.grammars, self.proposer = grammars, proposer
        self.new_seq_id, self.fail_request = new_seq_id, fail_request
        self.beam_groups: dict[str, BeamGroup] = {}  # request_id -> its beams, for beam_width > 1

    # ----------------------------------------------------------------- requests' lives
    def start_beams(self, request_id: str, width: int, seq: Sequence) -> None:
        """A request searched by `width` beams, starting from its one sequence."""
        self.beam_groups[request_id] = BeamGroup(width, live=[(seq, 0.0)])

    def forget(self, request_id: str) -> None:
        """The request is answered: its beams and its sequences' n-gram indexes go."""
        if self.proposer is not None:
            for seq in self.requests[request_id]:
                self.proposer.forget(seq.seq_id)
        self.beam_groups.pop(request_id, None)

    def guesses_for(self, seq: Sequence, most: int, batch: int) -> list[int]:
        """At most `most` speculated tokens to follow a decoding sequence, among `batch` running
        ones. Beams choose among each other's scores, not one draw at a time: they do not guess."""
        if seq.request_id in self.beam_groups:
            return []
        return self.proposer.propose(seq.seq_id, seq.token_ids, most, batch)

    # ----------------------------------------------------------------- guesses and prompts
    def check_guesses(
        self, guessed: list[tuple[ScheduledSequence, int]], forward
    ) -> tuple[dict[int, int], dict[int, tuple]]:
        """Speculation: each guessing sequence (with its last row) keeps the guesses its sampler's
        draws agree with, and the draw that differed (`speculative.check_guesses`), appended now.
        Returns, per sequence id, the tokens it appended (its last token's KV and its kept guesses'
        are the ones kept), and, by sequence id, those that must stop: (seq, reason, None) for EOS
        or length among its tokens, (seq, "error", why) for a sampler that failed (nothing
        appended; its request ends alone)."""
        rows = [r for item, last in guessed for r in range(last - len(item.guesses), last + 1)]
        logits = self.runner.logits(forward.hidden, rows)  # (rows, vocab)
        finite = finite_rows(logits)
        kept, endings, first = {}, {}, 0
        for item, _ in guessed:
            seq, num_rows = item.seq, len(item.guesses) + 1
            rows_of_seq, finite_of_seq = logits[first : first + num_rows], finite[first : first + num_rows]
            first += num_rows
            if not all(finite_of_seq):
                kept[seq.seq_id] = 0
                endings[seq.seq_id] = (seq, "error", NOT_FINITE)
                continue
            try:
                tokens = check_guesses(item.guesses, rows_of_seq, self._guess_drawer(seq, item.guesses))
            except Exception as err:
                kept[seq.seq_id] = 0
                endings[seq.seq_id] = (seq, "error", f"Sampling failed ({type(err).__name__}: {err}).")
                continue
            self.proposer.record(seq.seq_id, len(item.guesses), len(tokens) - 1)
            self.stats.record_guesses(len(item.guesses), len(tokens) - 1)
            appended = 0
            for row, token in zip(rows_of_seq, tokens):  # row i's logits drew token i
                appended += 1
                reason = seq.append(token, self.eos_token_id, logprob_of(seq, row, token))
                if reason:
                    endings[seq.seq_id] = (seq, reason, None)
                    break
            kept[seq.seq_id] = appended
            self.runner.add_mass(seq, forward.guess_mass.get(seq.seq_id, [])[:appended])
        return kept, endings

    def _guess_drawer(self, seq: Sequence, guesses: list[int]) -> Callable[[torch.Tensor], int]:
        """The sampler `check_guesses` asks for each row (vocab,) of `seq`: row i is drawn after
        guesses[:i], the tokens before it, and its grammar moved on with each draw."""
        drawn: list[int] = []

        def sample(row: torch.Tensor) -> int:
            self.constrain([seq], row.unsqueeze(0))
            drawn.append(self.draw(seq, row, guesses[: len(drawn)]))
            return drawn[-1]

        return sample

    def score_prompts(self, schedule: Schedule, forward) -> None:
        """`prompt_logprobs`: each prompt token's log-probability (after the first), from the rows
        of this step's chunk that predict it: row p scores token p + 1. A token already scored (a
        prompt recomputed after a preemption) is not scored again."""
        wanted = []  # (seq, row, token position scored)
        for item, last in zip(schedule.sequences, forward.last_rows):
            seq = item.seq
            if seq.params.prompt_logprobs is None:
                continue
            start, end = seq.num_computed, seq.num_computed + item.num_tokens
            first_row = last - item.num_tokens + 1
            for position in range(max(start, len(seq.prompt_logprobs)), min(end, len(seq.prompt_ids) - 1)):
                wanted.append((seq, first_row + position - start, position + 1))
        if not wanted:
            return
        logits = self.runner.logits(forward.hidden, [row for _, row, _ in wanted])  # (scored, vocab)
        for (seq, _, target), row_logits in zip(wanted, logits):
            top = seq.params.prompt_logprobs
            seq.prompt_logprobs.append(token_logprob(row_logits, seq.prompt_ids[target], top))

    # ----------------------------------------------------------------- sampling
    def sample(self, ready: list[Sequence], logits: torch.Tensor) -> list[str]:
        """Give each ready sequence its next token from logits (ready, vocab); return the requests
        that changed, in order. A request whose sampling fails (its model scores are not finite,
        its own sampler raised, or chose no token of the vocabulary) ends alone with the error: the
        others keep exactly the tokens they drew, each from its own generator, and nothing wrong
        reaches the next forward pass."""
        changed: dict[str, None] = {}
        finite = finite_rows(logits)  # before any mask writes -inf
        self.constrain(ready, logits)
        for seq, seq_logits, ok in zip(ready, logits, finite):
            if seq.status is Status.FINISHED:  # its request failed earlier in this loop
                continue
            if not ok:
                self.fail_request(seq.request_id, NOT_FINITE)
                changed[seq.request_id] = None
                continue
            try:
                if not self.sample_one(seq, seq_logits):
                    continue
            except Exception as err:
                self.fail_request(seq.request_id, f"Sampling failed ({type(err).__name__}: {err}).")
            changed[seq.request_id] = None
        return list(changed)

    def sample_one(self, seq: Sequence, logits: torch.Tensor) -> bool:
        """The next token of `seq` (and of its forks) from its logits (vocab,); False when it is a
        beam still waiting for its siblings' scores, so nothing changed."""
        group = self.beam_groups.get(seq.request_id)
        if group is not None:
            if not group.offer(seq, logits):
                return False
            # every live beam has its next-token scores: choose
            beams = group.advance(self.scheduler, self.new_seq_id, self.eos_token_id)
            self.requests[seq.request_id][:] = beams
            return True
        for sample in self.samples_of(seq):  # n > 1: the first sampling forks the prompt
            token = self.draw(sample, logits)
            reason = sample.append(token, self.eos_token_id, logprob_of(sample, logits, token))
            if reason:
                self.scheduler.finish(sample, reason)
        return True

    def constrain(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Structured output: logits (rows, vocab), in place, row i keeping only the tokens
        seqs[i]'s grammar allows next; one batched mask (`structured.py`)."""
        if any(seq.grammar is not None for seq in seqs):
            self.grammars().mask_logits(logits, [seq.grammar for seq in seqs])

    def draw(self, seq: Sequence, logits: torch.Tensor, pending: list[int] = ()) -> int:
        """`seq`'s next token from logits (vocab,), masked by its grammar if it has one: its
        request's penalties and bias first (its tokens so far, then `pending`: guesses drawn
        before this row), then its sampler; the token moves its grammar on."""
        if seq.params.processes_logits:
            logits = process_logits(
                logits, seq.params, seq.prompt_ids, [*seq.output_ids, *pending], self.eos_token_id
            )
        grammar = seq.grammar
        if grammar is not None and seq.params.processes_logits and not torch.isfinite(logits).any():
            raise ValueError("no token is left to draw: min_tokens or logit_bias bans all the grammar allows")
        token = self.token_of(seq.sampler(logits))
        if grammar is not None:
            grammar.advance(token)
        return token

    def token_of(self, chosen) -> int:
        """A sampler's choice, checked: a custom sampler's id outside the vocabulary would fail
        the next forward pass, and with it every sequence in that step."""
        if isinstance(chosen, bool) or not isinstance(chosen, int) or not 0 <= chosen < self.vocab_size:
            raise ValueError(f"the sampler chose {chosen!r}, not a token id in [0, {self.vocab_size})")
        return chosen

    def samples_of(self, seq: Sequence) -> list[Sequence]:
        """The sequences that sample from `seq`'s logits: itself, and when a request with n > 1
        samples for the first time, n - 1 forks sharing its blocks (parallel sampling)."""
        if seq.params.n == 1 or len(self.requests[seq.request_id]) == seq.params.n:
            return [seq]
        forks = [seq.fork(self.new_seq_id(), index) for index in range(1, seq.params.n)]
        for child in forks:
            self.scheduler.fork(seq, child)
        self.requests[seq.request_id] += forks
        return [seq, *forks]


def logprob_of(seq: Sequence, logits: torch.Tensor, token: int) -> TokenLogprob | None:
    """The token's log-probability under `logits` (vocab,), if the sequence's request asks."""
    top = seq.params.logprobs
    return None if top is None else token_logprob(logits, token, top)

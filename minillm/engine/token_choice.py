"""Token choice: from a step's hidden states to the tokens sequences append.

After the forward pass (`runner.py`) the engine hands the rows it needs to the `TokenChooser`,
which owns every way a token is chosen:
  - guess checks (speculation, `speculative.py`): a guessing sequence keeps the guesses its own
    sampler's draws agree with, and the draw that differed; the proposer learns from each check,
    and from what a decode step costs;
  - prompt scoring (`prompt_logprobs`): each prompt token's log-probability, from the rows that
    predict it;
  - sampling: penalties and bias (`sampling.process_logits`), then the sequence's sampler, its
    choice checked against the vocabulary;
  - constraints (structured output, `structured.py`): one batched mask of what each grammar allows;
  - forks: n samples fork at their first token; beams choose among each other's scores and
    advance together (`beam.py`).

It owns no sequence's place in the batch: what its choices change there (forks, sequences that
end, requests that fail) it returns, in order, as `Change`s (`sequence.py`), and the engine has
the scheduler carry them out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from minillm.engine.beam import BeamGroup
from minillm.engine.outputs import EngineStats
from minillm.engine.runner import Forward, ModelRunner
from minillm.engine.scheduler import Schedule
from minillm.engine.sequence import Change, Fail, Finish, Fork, Sequence, Status
from minillm.engine.speculative import NgramProposer, check_guesses
from minillm.sampling import TokenLogprob, process_logits, token_logprob
from minillm.structured import Grammars
from minillm.tokenizer import Tokenizer

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


@dataclass
class Choice:
    """What token choice did in a step: the requests that changed (in order), the tokens appended
    (`kept`: per guessing sequence, how many: its kept guesses and the draw after them), the
    changes for the scheduler to carry out (in order), and the requests whose sequences are now
    others (request_id -> its sequences: n samples forked, beams advanced)."""

    changed: list[str] = field(default_factory=list)
    appended: int = 0
    kept: dict[int, int] = field(default_factory=dict)
    changes: list[Change] = field(default_factory=list)
    families: dict[str, list[Sequence]] = field(default_factory=dict)


class TokenChooser:
    def __init__(
        self,
        runner: ModelRunner,
        stats: EngineStats,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        tokenizer: Tokenizer | None,
        proposer: NgramProposer | None,
        seq_ids: Iterator[int],
    ):
        """`tokenizer`: what structured output's grammars are compiled against (None: no
        structured output); `proposer`: speculation's guesser, None without it; `seq_ids`: the
        engine's sequence ids, which forks take theirs from too."""
        self.runner, self.stats = runner, stats
        self.eos_token_ids, self.vocab_size, self.tokenizer = eos_token_ids, vocab_size, tokenizer
        self.proposer, self.seq_ids = proposer, seq_ids
        self._grammars: Grammars | None = None  # built on the first structured-output request
        self.beam_groups: dict[str, BeamGroup] = {}  # request_id -> its beams, for beam_width > 1
        self._checked: dict[int, list[int]] = {}  # seq_id -> the guesses the last step checked

    # ----------------------------------------------------------------- requests' lives
    def grammars(self) -> Grammars:
        """Structured output's grammar compiler for the vocabulary, built when first asked."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError("Structured output needs the checkpoint's tokenizer; this engine has none.")
            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._grammars

    def start_beams(self, request_id: str, width: int, seq: Sequence) -> None:
        """A request searched by `width` beams, starting from its one sequence."""
        self.beam_groups[request_id] = BeamGroup(width, live=[(seq, 0.0)])

    def forget(self, request_id: str, seqs: list[Sequence]) -> None:
        """The request (its sequences `seqs`) is answered: its beams and n-gram indexes go."""
        if self.proposer is not None:
            for seq in seqs:
                self.proposer.forget(seq.seq_id)
        self.beam_groups.pop(request_id, None)

    def checked_guesses(self) -> dict[int, list[int]]:
        """Speculation in the last step: seq_id -> the tokens guessed after its last token and
        checked in that pass, kept or not; empty when nobody guessed."""
        return dict(self._checked)

    # ----------------------------------------------------------------- before `computed`
    def check(self, schedule: Schedule, forward: Forward) -> Choice:
        """What must be read before the step's tokens count as computed: prompts scored, and
        guesses checked (`check_guesses`): the guessing sequences that must stop are its changes."""
        self.score_prompts(schedule, forward)
        guessed = [(item, row) for item, row in zip(schedule.sequences, forward.last_rows) if item.guesses]
        self._checked = {item.seq.seq_id: list(item.guesses) for item, _ in guessed}
        choice = Choice(changed=[item.seq.request_id for item, _ in guessed])
        if guessed:
            choice.kept = self.check_guesses(guessed, forward, choice)
            choice.appended = sum(choice.kept.values())
        return choice

    def check_guesses(self, guessed: list[tuple], forward: Forward, choice: Choice) -> dict[int, int]:
        """Speculation: each guessing sequence (with its last row) keeps the guesses its sampler's
        draws agree with, and the draw that differed (`speculative.check_guesses`), appended now.
        Returns, per sequence id, the tokens it appended (its last token's KV and its kept guesses'
        are the ones kept); those that must stop go into `choice.changes`: a `Finish` for EOS or
        length among its tokens, a `Fail` for a sampler that failed (nothing appended; its request
        ends alone)."""
        rows = [r for item, last in guessed for r in range(last - len(item.guesses), last + 1)]
        logits = self.runner.logits(forward.hidden, rows)  # (rows, vocab)
        finite = finite_rows(logits)
        kept, first = {}, 0
        for item, _ in guessed:
            seq, num_rows = item.seq, len(item.guesses) + 1
            rows_of_seq, finite_of_seq = logits[first : first + num_rows], finite[first : first + num_rows]
            first += num_rows
            kept[seq.seq_id] = 0
            if not all(finite_of_seq):
                choice.changes.append(Fail(seq.request_id, NOT_FINITE))
                continue
            try:
                tokens = check_guesses(item.guesses, rows_of_seq, self._guess_drawer(seq, item.guesses))
            except Exception as err:
                choice.changes.append(Fail(seq.request_id, f"Sampling failed ({type(err).__name__}: {err})."))
                continue
            self.proposer.record(seq.seq_id, len(item.guesses), len(tokens) - 1)
            self.stats.record_guesses(len(item.guesses), len(tokens) - 1)
            for row, token in zip(rows_of_seq, tokens):  # row i's logits drew token i
                kept[seq.seq_id] += 1
                reason = seq.append(token, self.eos_token_ids, logprob_of(seq, row, token))
                if reason:
                    choice.changes.append(Finish(seq, reason))
                    break
        return kept

    def _guess_drawer(self, seq: Sequence, guesses: list[int]) -> Callable[[torch.Tensor], int]:
        """The sampler `check_guesses` asks for each row (vocab,) of `seq`: row i is drawn after
        guesses[:i], the tokens before it, and its grammar moved on with each draw."""
        drawn: list[int] = []

        def sample(row: torch.Tensor) -> int:
            self.constrain([seq], row.unsqueeze(0))
            drawn.append(self.draw(seq, row, guesses[: len(drawn)]))
            return drawn[-1]

        return sample

    def score_prompts(self, schedule: Schedule, forward: Forward) -> None:
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

    # ----------------------------------------------------------------- after `computed`
    def choose(self, schedule: Schedule, forward: Forward) -> Choice:
        """The next token of every sequence whose tokens are all computed (guessing ones have
        theirs from `check`); then speculation learns what this step cost, if it was a decode
        step (the pass, its logits and the checks: what guesses are priced by)."""
        ready = [
            (item.seq, row)
            for item, row in zip(schedule.sequences, forward.last_rows)
            if item.seq.num_uncomputed == 0 and not item.guesses
        ]
        choice = Choice(appended=len(ready))
        if ready:
            logits = self.runner.logits(forward.hidden, [row for _, row in ready])  # (sequences ready, vocab)
            self.sample([seq for seq, _ in ready], logits, choice)
        decoding = all(item.num_tokens == 1 or item.guesses for item in schedule.sequences)
        if self.proposer is not None and decoding:
            rows = sum(item.num_tokens for item in schedule.sequences)
            self.proposer.cost.record(rows, time.perf_counter() - forward.started)
        return choice

    def sample(self, ready: list[Sequence], logits: torch.Tensor, choice: Choice) -> None:
        """Give each ready sequence its next token from logits (ready, vocab), noting in `choice`
        the requests that changed, in order. A request whose sampling fails (its model scores are
        not finite, its own sampler raised, or chose no token of the vocabulary) ends alone with
        the error: the others keep exactly the tokens they drew, each from its own generator, and
        nothing wrong reaches the next forward pass."""
        changed: dict[str, None] = {}
        finite = finite_rows(logits)  # before any mask writes -inf
        self.constrain(ready, logits)
        failed: set[str] = set()  # requests that failed in this loop
        ended: set[int] = set()  # beams that ended in this loop (pruned, or finished)
        for seq, seq_logits, ok in zip(ready, logits, finite):
            if seq.status is Status.FINISHED or seq.seq_id in ended or seq.request_id in failed:
                continue  # ended earlier in this step: a beam pruned, or its request failed
            error = None
            if not ok:
                error = NOT_FINITE
            else:
                try:
                    decided = len(choice.changes)
                    if not self.sample_one(seq, seq_logits, choice):
                        continue
                    ended.update(c.seq.seq_id for c in choice.changes[decided:] if isinstance(c, Finish))
                except Exception as err:
                    error = f"Sampling failed ({type(err).__name__}: {err})."
            if error is not None:
                failed.add(seq.request_id)
                choice.changes.append(Fail(seq.request_id, error))
            changed[seq.request_id] = None
        choice.changed = list(changed)

    def sample_one(self, seq: Sequence, logits: torch.Tensor, choice: Choice) -> bool:
        """The next token of `seq` (and of its forks) from its logits (vocab,); False when it is a
        beam still waiting for its siblings' scores, so nothing changed."""
        group = self.beam_groups.get(seq.request_id)
        if group is not None:
            if not group.offer(seq, logits):
                return False
            # every live beam has its next-token scores: choose
            beams, changes = group.advance(self.seq_ids, self.eos_token_ids)
            choice.families[seq.request_id] = beams
            choice.changes += changes
            return True
        for sample in self.samples_of(seq, choice):  # n > 1: the first sampling forks the prompt
            token = self.draw(sample, logits)
            reason = sample.append(token, self.eos_token_ids, logprob_of(sample, logits, token))
            if reason:
                choice.changes.append(Finish(sample, reason))
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
                logits, seq.params, seq.prompt_ids, [*seq.output_ids, *pending], self.eos_token_ids
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

    def samples_of(self, seq: Sequence, choice: Choice) -> list[Sequence]:
        """The sequences that sample from `seq`'s logits: itself, and when a request with n > 1
        samples for the first time, n - 1 forks sharing its blocks (parallel sampling)."""
        if seq.params.n == 1 or seq.output_ids:
            return [seq]
        forks = [seq.fork(next(self.seq_ids), index) for index in range(1, seq.params.n)]
        choice.changes += [Fork(seq, child) for child in forks]
        choice.families[seq.request_id] = [seq, *forks]
        return [seq, *forks]


def logprob_of(seq: Sequence, logits: torch.Tensor, token: int) -> TokenLogprob | None:
    """The token's log-probability under `logits` (vocab,), if the sequence's request asks."""
    top = seq.params.logprobs
    return None if top is None else token_logprob(logits, token, top)

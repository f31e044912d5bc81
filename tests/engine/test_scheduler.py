"""The engine core's scheduling policy on its own (app/engine/scheduler.py): which waiting prompts
go together, when a prompt goes in pieces and how large, and what fits the KV budget; no model."""

from __future__ import annotations

from attnlens.app.engine.request import Generation, GenerationParams
from attnlens.app.engine.scheduler import Scheduler


class Blocks:
    """A cache in blocks as the scheduler reads it: 64-position blocks of 1 byte each."""

    capacity = 1024
    lengths = keys = values = []
    bytes_held = 0

    def bytes_for_lengths(self, lengths: list[int]) -> int:
        return sum(-(-n // 64) for n in lengths)

    def row_slice(self, rows, batch):
        return rows

    def free(self, row): ...

    def move(self, src, dst): ...

    def reset(self): ...

    def trim(self, active_rows):
        return False


def gen(n: int, new: int = 8, **kw) -> Generation:
    return Generation(GenerationParams(list(range(1, n + 1)), new, **kw))


def scheduler(budget: int | None = None, chunk: int = 256, alone: int | None = 2048) -> Scheduler:
    return Scheduler(Blocks(), 1024, kv_budget=budget, prefill_chunk=chunk, prefill_chunk_alone=alone)


def test_short_prompts_go_together_while_the_padded_batch_holds_at_most_one_context():
    s = scheduler()
    s.waiting.extend([gen(200), gen(100), gen(250), gen(240), gen(30)])
    batch = s.next_prefills()
    assert [len(g.params.prompt_ids) for g in batch] == [200, 100, 250, 240]  # 5 x 250 > 1,024
    assert [len(g.params.prompt_ids) for g in s.next_prefills()] == [30]


def test_a_prompt_to_score_goes_alone_and_a_long_one_in_pieces():
    s = scheduler()
    s.waiting.extend([gen(10, prompt_logprobs=1), gen(10), gen(300), gen(20)])
    assert len(s.next_prefills()) == 1  # echo: alone
    first = s.next_prefills()
    assert [len(g.params.prompt_ids) for g in first] == [10]  # stops before the long one
    long = s.next_prefills()[0]
    assert s.chunked(long) and not s.chunked(gen(300, ablate=(object(),)))  # a mean ablation needs it whole
    s.chunking = long
    s.waiting.extend([gen(400), gen(5)])
    assert [len(g.params.prompt_ids) for g in s.next_prefills()] == [20]  # short ones go beside it
    assert s.next_prefills() == []  # another long prompt waits for this one (one at a time)


def test_the_piece_is_larger_while_nothing_else_decodes_or_waits():
    s = scheduler(chunk=256, alone=2048)
    assert s.piece_size(others_waiting=False) == 2048
    assert s.piece_size(others_waiting=True) == 256
    s.decoding.append(gen(4))
    assert s.piece_size(others_waiting=False) == 256


def test_what_does_not_fit_the_budget_waits_and_one_alone_always_fits():
    s = scheduler(budget=4)  # four blocks
    s.waiting.append(gen(500, new=500))  # 16 blocks: alone, it still runs
    assert len(s.next_prefills()) == 1
    s.decoding.append(gen(100, new=20))  # holds 2 blocks at most
    s.waiting.extend([gen(100, new=20), gen(100, new=20)])
    assert len(s.next_prefills()) == 1  # 2 + 2 fit; 2 + 2 + 2 do not
    assert s.waiting and not s.fits([s.waiting[0], s.waiting[0]])

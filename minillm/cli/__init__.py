"""The `minillm` command line: `main` parses the flags and runs one command.

commands.py         chat, info and `main`: each command an `add_X` that declares its flags and a `cmd_X`
generate.py         generate: one prompt on the single-sequence decoders or the serving engine
serve.py            serve: the HTTP server
route.py            route: the KV-aware router in front of several servers (minillm/route/)
measure.py          bench decode|attention|chat-view|all: the commands that measure speed
measure_serving.py  bench serve|serve-http|prefix: the engine under many requests
measure_memory.py   bench memory and eval: what the memory system's choices cost
measure_tiers.py    bench tiers: preemption, resume, prefix spill, the spill rule
measure_scheduling.py  bench scheduling: admission policies against first come first served
measure_staircase.py   bench staircase: HF transformers, then paging, int8 KV, flash prefill in turn
measure_fleet.py    bench fleet: a Redis KV store two engines share, the KV-aware router
trace.py            trace show: a --trace file's KV memory, summarized and drawn (minillm/trace/)
trace_serve.py      trace serve: a traced run replayed in the browser (minillm/view/, the memory page)
flags.py            the flag groups several commands share, made from `config.SWITCHES`
"""

from minillm.cli.commands import main

__all__ = ["main"]

"""`minillm chat`: a multi-turn conversation in the terminal, and what it costs, turn by turn.

A chat model has no memory between turns: every turn's prompt is the whole conversation so far,
rendered by the chat template, so the prompt grows with each turn. Run on the serving engine with
the prefix cache on, the KV blocks an earlier turn computed are found in the cache, and only the
newest turn is prefilled. /stats shows it after each reply: the prompt's tokens and how many of
them were reused from the cache, time to first token, decode speed, the KV memory the
conversation holds, and the pool's cached and free blocks.
"""

from __future__ import annotations

from minillm.report import console

CHAT_HELP = "/reset clears the conversation, /stats shows speed, KV memory and prefix reuse, /exit quits."


class Chat:
    """One conversation on `llm`, an `LLM` built with prefix_caching=True; it owns the history."""

    def __init__(self, llm, params, system: str | None):
        self.llm, self.params = llm, params
        self.initial = [{"role": "system", "content": system}] if system else []
        self.reset()

    def reset(self) -> None:
        self.history: list[dict[str, str]] = list(self.initial)
        self.last = None  # (output, prompt tokens reused from the prefix cache) of the newest reply

    def reply(self, user: str) -> None:
        """Stream the answer to `user`. A turn that fails (e.g. the conversation outgrew the
        context) leaves the history as it was."""
        tokenizer, cache = self.llm.engine.tokenizer, self.llm.engine.block_manager.prefix_cache
        self.history.append({"role": "user", "content": user})
        hits_before = cache.hit_blocks
        text, out = tokenizer.stream_decoder(), None
        console.print("[bold blue]smol>[/bold blue] ", end="")
        for out in self.llm.stream(tokenizer.encode_chat(self.history), self.params):
            token = out.token_ids[-1] if out.token_ids else None
            if token is not None and token != tokenizer.eos_token_id:
                console.print(text.feed(token), end="", markup=False, highlight=False)
        if out.finish_reason == "error":
            self.history.pop()
            console.print(f"\n[red]error:[/red] {out.error} Type /reset to start over.")
            return
        console.print(text.flush())
        self.history.append({"role": "assistant", "content": out.text})
        self.last = (out, (cache.hit_blocks - hits_before) * cache.block_size)

    def stats(self) -> str:
        if self.last is None:
            return "[dim]no reply yet[/dim]"
        out, reused_tokens = self.last
        engine = self.llm.engine
        per_token = engine.pool.bytes_per_slot
        held = len(out.prompt_token_ids) + len(out.token_ids)
        decode = f"{1 / out.tpot:.1f} tok/s" if out.tpot else "n/a"
        return (f"prompt {len(out.prompt_token_ids)} tokens ({reused_tokens} reused from the prefix cache), "
                f"reply {len(out.token_ids)} tokens | first token {out.ttft * 1000:.0f} ms | decode {decode} | "
                f"KV cache {per_token:,} B/token x {held} tokens = {per_token * held / 2**20:.1f} MiB; "
                f"{len(engine.block_manager.prefix_cache.entries)} blocks cached, "
                f"{engine.block_manager.num_free_blocks} of {engine.block_manager.num_blocks} blocks free")

    def run(self, model_name: str) -> None:
        """Read a line, run it as a command or answer it; until /exit or the end of the input."""
        console.print(f"[bold]minillm chat[/bold] — {model_name}, paged KV with prefix caching. {CHAT_HELP}")
        while True:
            try:
                user = console.input("[bold green]you>[/bold green] ").strip()
            except (EOFError, KeyboardInterrupt):
                console.print()
                return
            if user in ("/exit", "/quit"):
                return
            if user == "/reset":
                self.reset()
                console.print("[dim]conversation cleared[/dim]")
            elif user == "/stats":
                console.print(self.stats())
            elif user:
                self.reply(user)

"""The decision's text stages alone, stage by stage, for long chats: parse, normalize, render, split.

One timed iteration of each stage on first-turn chats of about 1k / 4k / 16k tokens (the decision bench's
:class:`load.bench.decision.ChatFactory`, the real SmolLM2 tokenizer and template), rotating through 8
chats a size:

* ``parse``: :func:`extproc.routing.request.parse_body` on the raw request bytes (``orjson`` alone beside
  it, as ``orjson_loads``);
* ``normalize``: :func:`extproc.models.template.normalize_messages` (the messages vLLM hands the template);
* ``render``: :meth:`ChatTemplate.render` as the router calls it, SmolLM2's template (``message['role']``
  item access, ``loop.first``), normalization included;
* ``render_attribute_style``: the same with a Qwen-style template (``message.role``, ``message.content``,
  ``.strip()``, ``loop.first``: one sandboxed attribute access or more a message);
* ``split``: :meth:`SegmentTokenizer.split` of the rendered prompt (cut at added tokens);
* ``render_follow_up``: the next turn of those chats (a new reply and user message, parsed afresh each
  time), rendered from the memo of the chat's own render (:mod:`extproc.models.render_memo`), and
  ``render_follow_up_whole`` the same requests rendered whole (the template with ``memo=False``).

    python -m load.bench.render --out results/render.json [--quick] [--iterations N]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from engines.gguf import ensure_model_dir, smollm2_gguf_path
from extproc.models.registry import ModelAssets
from extproc.models.template import ChatTemplate, normalize_messages
from extproc.routing.request import Kind, ParsedRequest, parse_body
from load.bench import CpuSample, add_quiet_arguments, machine, quietest, revision, summary, write_json
from load.bench.decision import MODEL, SIZES, ChatFactory, body

CHATS_PER_SIZE = 8
ATTRIBUTE_STYLE = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content.strip() + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""A Qwen2.5-style template: messages read as attributes, as many hub templates do."""
STAGES = (
    "parse",
    "orjson_loads",
    "normalize",
    "render",
    "render_attribute_style",
    "split",
    "render_follow_up",
    "render_follow_up_whole",
)


def _render(template: ChatTemplate, request: ParsedRequest) -> str:
    return template.render(
        request.messages,
        tools=request.tools,
        add_generation_prompt=request.add_generation_prompt,
        extra=request.template_kwargs,
    )


def run_cell(
    assets: ModelAssets,
    attribute_style: ChatTemplate,
    raws: list[bytes],
    iterations: int,
    warmup: int,
    follow_ups: list[bytes] | None = None,
) -> dict[str, Any]:
    """Each stage timed ``iterations`` times over ``raws`` (after ``warmup`` untimed), one stage at a time;
    ``follow_ups``: the next turns of ``raws`` (``follow_ups[i]`` continues ``raws[i % len(raws)]``)."""
    requests = [parse_body(Kind.CHAT, raw) for raw in raws]
    texts = [_render(assets.template, r) for r in requests]
    fmt = assets.template.content_format
    whole = ChatTemplate(assets.template.source, special_tokens=assets.template.special_tokens, memo=False)
    nexts = [parse_body(Kind.CHAT, raw) for raw in follow_ups or raws]
    stages: dict[str, Callable[[int], object]] = {
        "parse": lambda i: parse_body(Kind.CHAT, raws[i % len(raws)]),
        "orjson_loads": lambda i: orjson.loads(raws[i % len(raws)]),
        "normalize": lambda i: normalize_messages(requests[i % len(raws)].messages, fmt),
        "render": lambda i: _render(assets.template, requests[i % len(raws)]),
        "render_attribute_style": lambda i: _render(attribute_style, requests[i % len(raws)]),
        "split": lambda i: assets.tokenizer.split(texts[i % len(raws)]),
        "render_follow_up": lambda i: _render(assets.template, nexts[i % len(nexts)]),
        "render_follow_up_whole": lambda i: _render(whole, nexts[i % len(nexts)]),
    }
    out: dict[str, Any] = {}
    cpu = CpuSample.take()
    for name, stage in stages.items():
        for i in range(warmup):
            stage(i)
        samples = []
        gc.collect()
        gc.disable()  # the stages' own cost: collections are the decision bench's --gc subject
        try:
            for i in range(iterations):
                started = time.perf_counter_ns()
                stage(i)
                samples.append((time.perf_counter_ns() - started) / 1e3)
        finally:
            gc.enable()
        out[name] = summary(samples)
    return {"other_cpu_cores": cpu.other_cores(CpuSample.take()), "stages_us": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m load.bench.render", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON results file")
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run (figures meaningless)")
    parser.add_argument("--iterations", type=int, default=500, help="timed iterations per stage and size")
    parser.add_argument("--warmup", type=int, default=30, help="untimed iterations before each stage")
    parser.add_argument("--seed", type=int, default=1)
    add_quiet_arguments(parser, "size")
    args = parser.parse_args(argv)
    sizes: tuple[int, ...] = SIZES
    if args.quick:
        sizes, args.iterations, args.warmup = (1024,), 5, 2
        args.max_attempts, args.quiet_wait_s = 1, 0.0
    started = time.monotonic()
    info = machine()
    assets = ModelAssets.load(MODEL, ensure_model_dir(smollm2_gguf_path()))
    attribute_style = ChatTemplate(ATTRIBUTE_STYLE, special_tokens=assets.template.special_tokens)
    factory = ChatFactory(args.seed)
    turns = ChatFactory(args.seed + 1)  # the follow-ups' own: the chats stay those of earlier runs
    sample = factory.conversation(3000)
    words = sum(m["content"].count(" ") + 1 for m in sample)
    ratio = words / len(
        assets.tokenizer.encode_whole(assets.template.render(sample), add_special_tokens=False)
    )
    cells = []
    for size in sizes:
        chats = [factory.conversation(round(size * ratio)) for _ in range(CHATS_PER_SIZE)]
        raws = [body(chat) for chat in chats]
        follow_ups = [body(chats[i % len(chats)] + turns.follow_up()) for i in range(args.iterations)]
        tokens = [
            len(
                assets.tokenizer.encode_whole(
                    assets.template.render(c, add_generation_prompt=True), add_special_tokens=False
                )
            )
            for c in chats
        ]
        cell = quietest(
            partial(run_cell, assets, attribute_style, raws, args.iterations, args.warmup, follow_ups),
            args.quiet_threshold,
            args.max_attempts,
            args.quiet_wait_s,
        )
        cells.append(
            {
                "target_tokens": size,
                "prompt_tokens": summary(tokens, 0),
                "messages": summary([len(c) for c in chats], 0),
                "body_bytes": summary([len(r) for r in raws], 0),
                **cell,
            }
        )
        line = " ".join(f"{k} {v['p50']:.1f}/{v['p99']:.1f}" for k, v in cell["stages_us"].items())
        print(
            f"{size:>6} tok: {line} us p50/p99 (other tenants {cell['other_cpu_cores']:.2f})", file=sys.stderr
        )
    write_json(
        args.out,
        {
            "benchmark": "render",
            "command": " ".join(
                ["python -m load.bench.render", *(argv if argv is not None else sys.argv[1:])]
            ),
            "machine": info,
            "revision": revision(),
            "parameters": {
                "quick": args.quick,
                "iterations": args.iterations,
                "warmup": args.warmup,
                "chats_per_size": CHATS_PER_SIZE,
                "seed": args.seed,
                "model": MODEL,
                "words_per_token": round(ratio, 3),
            },
            "unit": "microseconds",
            "cells": cells,
            "wall_s": round(time.monotonic() - started, 1),
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

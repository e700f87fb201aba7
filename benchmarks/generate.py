"""Greedy generation with a static KV cache: tokens per second, weight memory and first-call time.

    python benchmarks/generate.py [--tiny] [--layers 4] [--batch 1,16] [--prompt 16] [--new-tokens 64]
                                  [--configs NAME,...] [--rounds 3] [--cudagraphs] [--budget SECONDS]
                                  [--profile NAME,...]

A Llama-architecture model built from a transformers LlamaConfig with random weights (Llama-3-8B
dims: hidden 4096, intermediate 14336, 32 heads, 8 KV heads, vocab 128256; ``--layers`` decoder
layers; ``--tiny``: a model small enough for the CPU) generates ``--new-tokens`` tokens greedily
after a random ``--prompt``-token prompt, one compiled forward per step on a transformers
StaticCache, under each configuration of inference_configs.py side by side (bf16 torch.compile,
torchao's dynamic FP8, graphquant's recipes per-call and frozen). Rounds alternate the
configurations (each round in its own shuffled order); a generation's time covers its prefill and every decode step, and
tokens/s counts the generated tokens of the whole batch, beside its ratio to bf16 torch.compile's
in the same run where that ran. "first gen s" is the first generation at
that batch size (its compiles included). "weights GiB" counts every parameter and buffer of the
model (embedding and norms included; a tensor subclass by its inner tensors), the KV cache not.
"= per-call" says whether a frozen configuration generated the very tokens its per-call one did.
Each configuration compiles a graph per shape: the prefill and the decode step at each batch size,
one graph per batch size with ``--prompt 1``. A configuration that fails is listed under the table
and the others still run; ``--budget`` leaves out those not built by then. On the CPU every
configuration compiles with aot_eager (no Inductor build) and times are only a smoke test.
``--profile NAME`` lists, after the table, the CUDA kernels of one generation of that configuration
at each batch size, per generated token (launches and GPU us; with ``--prompt 1`` every step is a
decode step of one shape, so these are one step's kernels).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
import traceback

import torch
from tabulate import tabulate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from common import cuda_kernels, seconds, turns  # noqa: E402
from inference_configs import BF16, allow_graphs, build, configs, per_call, weight_bytes  # noqa: E402

LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
TINY = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def llama(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    """The bf16 model every configuration starts from (one seed: the same weights for all)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = TINY if args.tiny else LLAMA_3_8B
    config = LlamaConfig(**dims, num_hidden_layers=args.layers, max_position_embeddings=args.prompt + args.new_tokens)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16).eval()


class Generation:
    """Greedy generation of one model at one batch size on its own StaticCache."""

    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> None:
        from transformers import LlamaForCausalLM, StaticCache

        config = model.config
        self.model, self.prompt, self.new_tokens = model, prompt, new_tokens
        # transformers renamed past_key_values to cache (the old name warns on every call)
        self.keyword = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
        self.cache = StaticCache(config=config, max_cache_len=prompt.shape[1] + new_tokens)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.cache.early_initialization(prompt.shape[0], config.num_key_value_heads, head_dim, torch.bfloat16, prompt.device)

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        """The (batch, new_tokens) generated token ids."""
        self.cache.reset()
        token, tokens = self.prompt, []
        for _ in range(self.new_tokens):
            logits = self.model(input_ids=token, use_cache=True, **{self.keyword: self.cache}).logits
            token = logits[:, -1].argmax(-1, keepdim=True)
            tokens.append(token)
        return torch.cat(tokens, dim=1)


class Run:
    """One configuration's model, warmed up: per batch size its Generation, the seconds and tokens
    of its first generation (compiles included); and its weight GiB."""

    def __init__(self, model: torch.nn.Module, prompts: dict[int, torch.Tensor], new_tokens: int, device: torch.device) -> None:
        self.weight_gib = weight_bytes(model) / 2**30
        self.generations, self.first, self.tokens = {}, {}, {}
        for b, prompt in prompts.items():
            self.generations[b] = Generation(model, prompt, new_tokens)
            self.first[b], self.tokens[b] = seconds(self.generations[b], device)
            self.generations[b]()  # a second warm-up: CUDA graphs record on the first replays


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a model small enough for the CPU (hidden 256, vocab 512)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default 4; 2 with --tiny)")
    parser.add_argument("--batch", default="1,16", help="batch sizes, comma-separated")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; 8 with --tiny)")
    parser.add_argument("--configs", default=None, help="comma-separated configuration names, built in this order (default: all available)")
    parser.add_argument("--budget", type=float, default=None,
                        help="seconds: configurations not built when this much time has passed are left out, so that a run "
                             "with a time limit still ends with its table")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cudagraphs", action="store_true", help="compile every configuration with mode='reduce-overhead'")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--profile", default="", help="comma-separated configuration names whose kernels to list (CUDA)")
    args = parser.parse_args(argv)
    args.layers = args.layers or (2 if args.tiny else 4)
    args.new_tokens = args.new_tokens or (8 if args.tiny else 64)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")]
    names = configs(args.configs.split(",") if args.configs else None, device)

    base = llama(args, device)
    vocab = base.config.vocab_size
    prompts = {b: torch.randint(0, vocab, (b, args.prompt), generator=torch.Generator().manual_seed(b)).to(device) for b in batches}
    print(f"{'tiny ' if args.tiny else ''}Llama ({base.config.hidden_size} hidden, {args.layers} layers, vocab {vocab}) "
          f"on {device}, {args.prompt}-token prompt, {args.new_tokens} new tokens, batches {batches}, {args.rounds} rounds"
          f"{', CUDA graphs' if args.cudagraphs else ''}", flush=True)

    allow_graphs(4 * len(names) * len(batches))  # a prefill and a decode graph per batch size, with room for a recompile each
    runs: dict[str, Run] = {}
    failed: dict[str, str] = {}
    start = time.perf_counter()
    for name in names:
        if args.budget is not None and time.perf_counter() - start > args.budget:
            print(f"  {name}: left out, past the --budget of {args.budget:g} s", flush=True)
            continue
        try:
            runs[name] = Run(build(name, base, device, args.cudagraphs), prompts, args.new_tokens, device)
        except Exception as error:  # one configuration's failure leaves the others' numbers, and is listed
            failed[name] = f"{type(error).__name__}: {error}".splitlines()[0]
            print(f"  {name}: FAILED {failed[name]}", flush=True)
            traceback.print_exc()
            continue
        print(f"  {name}: first generations {', '.join(f'{s:.1f} s' for s in runs[name].first.values())}", flush=True)
    del base

    samples: dict[tuple[str, int], list[float]] = {(name, b): [] for name in runs for b in batches}
    for r in range(args.rounds):
        for name in turns(list(runs), r):
            for b in batches:
                samples[name, b].append(seconds(runs[name].generations[b], device)[0])

    def tokens_per_s(name: str, b: int) -> str:  # with its ratio to bf16's in this run, where bf16 ran
        rate = {n: args.new_tokens * b / statistics.median(samples[n, b]) for n in (name, BF16) if n in runs}
        return f"{rate[name]:.0f}" + (f" ({rate[name] / rate[BF16]:.3f}x)" if BF16 in rate else "")

    rows = []
    for name, run in runs.items():
        unfrozen = runs.get(per_call(name))
        same = "" if unfrozen is None else "yes" if all(torch.equal(run.tokens[b], unfrozen.tokens[b]) for b in batches) else "NO"
        rows.append([name, *(tokens_per_s(name, b) for b in batches), f"{run.weight_gib:.3g}", *(f"{s:.1f}" for s in run.first.values()), same])
    headers = ["config", *(f"tok/s @{b} (x bf16)" for b in batches), "weights GiB", *(f"first gen s @{b}" for b in batches), "= per-call"]
    print()
    print(tabulate(rows, headers=headers, disable_numparse=True))
    for name, why in failed.items():
        print(f"{name}: failed: {why}")
    for name in filter(None, args.profile.split(",")):
        for b in batches:
            print_kernels_per_token(name, b, runs[name].generations[b], args.new_tokens)


def print_kernels_per_token(name: str, batch: int, generation: Generation, new_tokens: int) -> None:
    """One generation's CUDA kernels, each one's launches and GPU us per generated token."""
    found, span = cuda_kernels(generation, warmup=1)
    busy = sum(us for _, _, us in found) / new_tokens
    print(f"\n{name} @{batch}: per token {sum(c for _, c, _ in found) / new_tokens:.1f} launches, {busy:.1f} us on the GPU, "
          f"span {span / new_tokens:.1f} us")
    rows = sorted(((n[:110], c / new_tokens, us / new_tokens) for n, c, us in found), key=lambda row: -row[2])
    print(tabulate(rows, headers=["kernel", "launches", "us"], floatfmt=".1f"), flush=True)


if __name__ == "__main__":
    main()

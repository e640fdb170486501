"""How far each phase of a SmolLM2-135M PPO step is from this CPU's bound, for benchmarks/RESULTS.md.

The shapes are those of ``python benchmarks/ppo/bench_ppo.py --smollm2 [--workload long]``: batch
16, prompts left-padded to P, the dataset's longest (their real lengths read from the config's
dataset, with the long workload's overrides for ``--workload long``), T = 12 generated tokens
(128 for ``long``), ppo_batch_size 8, 2 PPO epochs, fp32 or bf16 (``--dtype``); the model is SmolLM2-135M (30 layers, dim 576,
9 heads / 3 KV heads of 64, MLP 1536, vocabulary 49152, tied embeddings). Per phase, as the
recipe runs it (``--response-len`` tokens per response):

- generate: the prefill (``[16, P]`` prompts; torchtune's decoder projects every prompt
  position to the vocabulary) and L - 1 decode steps of 16 rows, L the batch's longest
  response (``--longest-response``: the benchmark's mean of it; a call decodes until its last
  row ends), each of which reads every weight once (135M parameters x 4 bytes, 2 in bf16);
- score: the reference, value and reward trunks on the packed real tokens (prompt + response),
  the reference's vocabulary projection at the 16 x (mean response) reads;
- loss step: 2 epochs x 2 micro-steps of 8 packed sequences (prompt + response - 1 tokens),
  policy and value, forward + backward (the backward's two GEMMs per forward GEMM: 3x), the
  policy's vocabulary projection at the response reads;
- optimizer: 4 AdamW steps (fused) of policy + value, plus the gradient-norm clip: bytes (bf16:
  fp32 masters and moments stepped in one pass, ``compile.optimizer``).

The bound of a GEMM phase is the time torch.mm takes for exactly that phase's matrix products
on this machine (``nn.Linear``'s ``x @ W.t()`` and its backward's ``dY @ W`` and
``dY.t() @ X``, each the fastest of many calls: see :class:`Trunk`), measured here; attention
scores, softmax, norms, RoPE, SiLU and sampling are left out (their FLOPs are given apart). The memory bound is bytes /
bandwidth, bandwidth from a 1 GiB copy (read + written bytes) and a 1 GiB sum (read bytes).
Measured phase times are the benchmark's medians, passed in (defaults: ours, everything
compiled, run 1 of 2026-12-02 in RESULTS.md).

    OMP_NUM_THREADS=2 python benchmarks/bounds/smollm2_bound.py [--dtype bf16]   # or gemm_bound.py --smollm2
    OMP_NUM_THREADS=2 python benchmarks/bounds/smollm2_bound.py --workload long --response-len R --longest-response L ...
"""

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 30, 576, 9, 3, 64, 1536, 49152
KV = KV_HEADS * HEAD_DIM
# q, k, v, o, gate, up, down as nn.Linear weights [out, in]
LAYER_SHAPES = [(DIM, DIM), (KV, DIM), (KV, DIM), (DIM, DIM), (MLP, DIM), (MLP, DIM), (DIM, MLP)]
TRUNK_PARAMS = LAYERS * sum(o * i for o, i in LAYER_SHAPES)
PARAMS = TRUNK_PARAMS + VOCAB * DIM + (2 * LAYERS + 1) * DIM  # + tied embedding, RMSNorm scales
B, PPO_BATCH, EPOCHS = 16, 8, 2
ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "benchmarks/ppo")]
from bench_ppo import LONG_DATASET, LONG_TOKENS  # noqa: E402  (the long workload's dataset overrides)

# generated tokens (T) of each workload: the SmolLM2 config's, and bench_ppo's --workload long
WORKLOAD_T = {"arithmetic": 12, "long": LONG_TOKENS}

# ours, everything compiled: run 1 (learning, responses 12.0 tokens), medians in seconds
RUN1 = dict(generate=1.349, score=1.718, loss_step=8.082, optimizer=1.393)


def _seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Fastest of ``repeats`` timed calls after ``warmup`` untimed ones (a bound: the best the
    machine did, so a call slowed by another process does not count)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def prompt_tokens(workload: str = "arithmetic") -> Tuple[float, int, str]:
    """Mean and longest real prompt length of the workload's training prompts (the longest is
    P: the config's ``max_prompt_len: null``), and where they came from."""
    from omegaconf import OmegaConf
    from torchtune import config as tt_config

    import torchtune_ppo  # noqa: F401  (registers the ppo_asset resolver)

    cfg = OmegaConf.load(ROOT / "recipes/configs/smollm2/135M_ppo_arithmetic.yaml")
    if workload == "long":
        cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist(LONG_DATASET))
    try:
        tokenizer = tt_config.instantiate(cfg.tokenizer)
        data = tt_config.instantiate(cfg.dataset, tokenizer)
    except Exception as e:
        raise SystemExit(f"the {workload} workload's prompts could not be read ({type(e).__name__}: {e}); "
                         "prepare the model first: python tools/prepare_smollm2.py")
    lengths = [len(data[i]["tokens"]) for i in range(len(data))]
    return sum(lengths) / len(lengths), max(lengths), f"the {workload} workload's {len(lengths)} training prompts"


class Trunk:
    """Times the matrix products of 30 layers at ``m`` rows.

    Each distinct product (4 weight shapes; forward ``x @ W.t()``, backward ``dY @ W`` and
    ``dY.t() @ X``) is timed alone on one weight, fastest of ``REPEATS`` calls of a few ms each,
    and counted 30 times: on a shared machine short calls catch quiet moments that a whole
    30-layer sweep does not. At 16 rows (decode) a product reads its weight from memory more
    than it computes, so there the 30 layers' distinct weights are swept in turn instead.
    """

    REPEATS = 20

    def __init__(self, g: torch.Generator, dtype: torch.dtype = torch.float32) -> None:
        self.g, self.dtype = g, dtype
        self.vocab = self._randn(VOCAB, DIM)  # the tied embedding, [V, D]
        self._sweep = None

    def _randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.g).to(self.dtype)

    def _product(self, m: int, out: int, inn: int, kind: str) -> float:
        w = self._randn(out, inn)
        if kind == "fwd":
            x = self._randn(m, inn)
            return _seconds(lambda: x @ w.t(), self.REPEATS)
        dy = self._randn(m, out)
        if kind == "dx":
            return _seconds(lambda: dy @ w, self.REPEATS)
        x = self._randn(m, inn)
        return _seconds(lambda: dy.t() @ x, self.REPEATS)

    def _layers(self, m: int, kinds) -> float:
        per_layer = sum(self._product(m, o, i, k) for k in kinds for o, i in LAYER_SHAPES)
        return LAYERS * per_layer

    def forward(self, m: int) -> float:
        return self._layers(m, ("fwd",))

    def backward(self, m: int) -> float:
        """``dX = dY @ W`` and ``dW = dY.t() @ X`` for every weight."""
        return self._layers(m, ("dx", "dw"))

    def forward_streaming(self, m: int, repeats: int = 10) -> float:
        """The 30 layers' distinct weights in turn (decode: weights come from memory)."""
        if self._sweep is None:
            self._sweep = [self._randn(*sh) for sh in LAYER_SHAPES * LAYERS]
        x = {n: self._randn(m, n) for n in (DIM, MLP)}
        return _seconds(lambda: [x[w.shape[1]] @ w.t() for w in self._sweep], repeats)

    def vocab_forward(self, m: int, repeats: int = 10) -> float:
        x = self._randn(m, DIM)
        return _seconds(lambda: x @ self.vocab.t(), repeats)

    def vocab_backward(self, m: int, repeats: int = 10) -> float:
        dy, x = self._randn(m, VOCAB), self._randn(m, DIM)
        return _seconds(lambda: (dy @ self.vocab, dy.t() @ x), repeats)


def bandwidth() -> Dict[str, float]:
    """GB/s of a 1 GiB copy (read + written bytes) and of a 1 GiB sum (read bytes): larger
    than this machine's L3 (480 MiB)."""
    src = torch.ones(256 * 2**20)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    copy = _seconds(lambda: dst.copy_(src), 10)
    read = _seconds(lambda: src.sum(), 10)
    return {"copy": 2 * nbytes / copy / 1e9, "read": nbytes / read / 1e9}


def trunk_flops(m: float) -> float:
    return 2 * m * TRUNK_PARAMS


def attention_flops(queries: float, context: float) -> float:
    """Scores and weighted values, all heads and layers: ``4 * queries * context * H * Dh``."""
    return 4 * queries * context * HEADS * HEAD_DIM * LAYERS


def phases(p: float, r: float, trunk: Trunk, bw: Dict[str, float], *, P: int, T: int,
           longest: float) -> List[dict]:
    """Each phase's FLOPs, bytes, GEMM-bound time and bound, at mean prompt ``p`` and response
    ``r``, prompts padded to ``P``, ``longest`` the batch's longest response (mean over steps)."""
    out = []
    bf16 = trunk.dtype == torch.bfloat16
    width = 2 if bf16 else 4  # bytes a weight
    rows_prefill = B * P
    # generate: prefill on [16, P] padded rows, logits at every position ([B, P, V]); then
    # longest - 1 decode steps of 16 rows (one token each), each reading all weights once.
    decode_steps = max(round(longest) - 1, 0)
    prefill_vocab = trunk.vocab_forward(rows_prefill)
    prefill_gemm = trunk.forward(rows_prefill) + prefill_vocab
    decode_gemm = trunk.forward_streaming(B) + trunk.vocab_forward(B)
    stream = PARAMS * width / bw["read"] / 1e9  # s per decode step
    decode_bound = max(decode_gemm, stream)
    out.append(dict(
        phase="generate", flops=trunk_flops(rows_prefill) + 2 * rows_prefill * DIM * VOCAB
        + decode_steps * (trunk_flops(B) + 2 * B * DIM * VOCAB),
        other_flops=attention_flops(rows_prefill, P) + decode_steps * attention_flops(B, P + T),
        bound_s=prefill_gemm + decode_steps * decode_bound,
        detail=f"prefill GEMMs {prefill_gemm:.3f} s (of which {prefill_vocab:.3f} s the [{B}, {P}, {VOCAB}] "
               f"logits, only [{B}, {VOCAB}] of them read); {decode_steps} decode steps x "
               f"max(GEMMs {decode_gemm * 1e3:.1f} ms, streaming {PARAMS * width / 2**20:.0f} MiB at "
               f"{bw['read']:.1f} GB/s = {stream * 1e3:.1f} ms)",
        prefill_s=prefill_gemm, prefill_vocab_s=prefill_vocab, decode_step_gemm_s=decode_gemm,
        decode_step_stream_s=stream,
    ))
    # score: reference, value and reward trunks on the packed real tokens; reference logits
    # at the B * r response reads; value and reward heads [D, 1] (negligible).
    tokens = B * (p + r)
    reads = B * r
    one = trunk.forward(round(tokens))
    score_gemm = 3 * one + trunk.vocab_forward(round(reads))
    out.append(dict(
        phase="score", flops=3 * trunk_flops(tokens) + 2 * reads * DIM * VOCAB,
        other_flops=3 * attention_flops(tokens, p + r),
        bound_s=score_gemm,
        detail=f"3 trunks x {one:.3f} s at {round(tokens)} packed tokens + reference logits at {round(reads)} reads",
    ))
    # loss step: EPOCHS * B / PPO_BATCH micro-steps of PPO_BATCH sequences of p + r - 1 tokens,
    # policy and value forward + backward; policy logits at PPO_BATCH * r reads.
    micro = EPOCHS * B // PPO_BATCH
    m = round(PPO_BATCH * (p + r - 1))
    mr = round(PPO_BATCH * r)
    fwd, bwd = trunk.forward(m), trunk.backward(m)
    vocab = trunk.vocab_forward(mr) + trunk.vocab_backward(mr)
    loss_gemm = micro * (2 * (fwd + bwd) + vocab)
    out.append(dict(
        phase="loss step", flops=micro * 3 * (2 * trunk_flops(m) + 2 * mr * DIM * VOCAB),
        other_flops=micro * 3 * 2 * attention_flops(m, p + r - 1),
        bound_s=loss_gemm,
        detail=f"{micro} micro-steps x (2 models x (forward {fwd:.3f} s + backward {bwd:.3f} s) at "
               f"{m} tokens + policy logits fwd+bwd {vocab:.3f} s at {mr} reads)",
    ))
    # optimizer: fused AdamW reads param, grad, exp_avg, exp_avg_sq and writes param,
    # exp_avg, exp_avg_sq (28 bytes a parameter); clip_grad_norm reads the grads (4 more).
    # bf16 with fp32 masters in one pass (compile.optimizer): the bf16 gradient, the master and
    # both moments read, the master, the moments and the bf16 weight written (28), the norm's
    # read of the bf16 gradient (2 more).
    trained = 2 * PARAMS  # policy + value (the value head [1, D] instead of nothing: same count)
    per_param = 30 if bf16 else 32
    nbytes = micro * trained * per_param
    out.append(dict(
        phase="optimizer", flops=0.0, other_flops=micro * trained * 12.0,
        bound_s=nbytes / bw["copy"] / 1e9,
        detail=f"{micro} steps x {trained / 1e6:.0f}M parameters x {per_param} bytes = {nbytes / 1e9:.1f} GB "
               f"at {bw['copy']:.1f} GB/s (copy)",
    ))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", choices=tuple(WORKLOAD_T), default="arithmetic",
                    help="bench_ppo.py --smollm2's workload: its prompts (P, their mean) and T")
    ap.add_argument("--response-len", type=float, default=12.0,
                    help="mean response tokens of the measured steps (run 1: 12.0)")
    ap.add_argument("--longest-response", type=float, default=None,
                    help="mean over the measured steps of each batch's longest response (the "
                         "benchmark's 'response len (longest)'): decode steps + 1; default "
                         "--response-len, exact only when every row is as long")
    for k, v in RUN1.items():
        ap.add_argument(f"--{k.replace('_', '-')}-s", type=float, default=v, dest=k,
                        help=f"measured median seconds of the phase (default {v}: RESULTS.md, run 1, ours)")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="the products' and weights' dtype (bf16: AMX where the CPU has it; the "
                         "optimizer with fp32 masters in one pass)")
    ap.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = ap.parse_args(argv)

    p, P, where = prompt_tokens(args.workload)
    T = WORKLOAD_T[args.workload]
    longest = args.response_len if args.longest_response is None else args.longest_response
    if not 1 <= args.response_len <= longest <= T:
        ap.error(f"need 1 <= --response-len ({args.response_len}) <= --longest-response ({longest}) <= T ({T})")
    g = torch.Generator().manual_seed(0)
    trunk = Trunk(g, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    bw = bandwidth()
    rate_m = round(PPO_BATCH * (p + args.response_len - 1))
    a, w = torch.randn(rate_m, DIM, generator=g), torch.randn(MLP, DIM, generator=g)
    hot = 2 * rate_m * DIM * MLP / _seconds(lambda: a @ w.t(), 50) / 1e9
    a16, w16 = a.bfloat16(), w.bfloat16()  # what dtype=bf16 would give (AMX where the CPU has it)
    hot_bf16 = 2 * rate_m * DIM * MLP / _seconds(lambda: a16 @ w16.t(), 50) / 1e9
    rows = phases(p, args.response_len, trunk, bw, P=P, T=T, longest=longest)

    print(f"SmolLM2-135M ({PARAMS / 1e6:.1f}M parameters), {args.dtype}, batch {B}, P {P}, T {T}; "
          f"mean prompt {p:.2f} tokens ({where}), responses {args.response_len} tokens, the longest {longest}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bandwidth: copy {bw['copy']:.1f} GB/s "
          f"(read + written), sum {bw['read']:.1f} GB/s (read); one hot [{rate_m}, {DIM}] @ [{DIM}, {MLP}]: "
          f"{hot:.0f} GFLOP/s (bf16: {hot_bf16:.0f})")
    print("| phase | measured (s) | GEMM/memory bound (s) | measured / bound | GEMM GFLOP | "
          "bound's GFLOP/s | other FLOPs (GFLOP) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    total_m = total_b = 0.0
    for row in rows:
        key = row["phase"].replace(" ", "_")
        measured = getattr(args, key)
        row["measured_s"] = measured
        total_m += measured
        total_b += row["bound_s"]
        rate = row["flops"] / row["bound_s"] / 1e9 if row["flops"] else float("nan")
        print(f"| {row['phase']} | {measured:.3f} | {row['bound_s']:.3f} | {measured / row['bound_s']:.2f}x | "
              f"{row['flops'] / 1e9:.1f} | {rate:.0f} | {row['other_flops'] / 1e9:.1f} |")
    print(f"| step (these four) | {total_m:.3f} | {total_b:.3f} | {total_m / total_b:.2f}x | | | |")
    for row in rows:
        print(f"- {row['phase']}: {row['detail']}")
    if args.json:
        report = dict(workload=args.workload, prompt_tokens=p, P=P, T=T, longest_response=longest, bandwidth=bw, hot_gflops=hot, hot_bf16_gflops=hot_bf16, rows=rows,
                      threads=torch.get_num_threads(), torch=torch.__version__)
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

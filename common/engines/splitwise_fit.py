"""`kairos profile fit-splitwise`: fit a profile to the measured Splitwise step times.

common/data/splitwise/perf_model.csv (MIT, SplitwiseSim) holds, per model, GPU and tensor-parallel
degree, repeated runs of: a prefill of one prompt (128 to 8192 tokens), a prefill of a batch of
512-token prompts (1 to 64 of them), and the mean decode iteration of the run that follows. Each
configuration becomes one observation per kind, the median over its repeats:

- prefill: one step with the chunk (L, 0): T = L tokens, attention L**2/2;
- batched_prefill: one step with B chunks (512, 0): T = 512*B, attention B*512**2/2;
- decode: one decode step of B sequences with mean context L + O/2 (the context grows from the
  prompt L to L + O over the O output tokens, the iteration time is their mean).

Held out of the fit: within each kind, configurations sorted by size, every k-th (`--holdout-every`)
starting from the second, never the smallest or largest (the check is interpolation, not
extrapolation). The fit minimises the mean absolute relative error (MAPE, the figure it reports)
of the rest, every observation weighted equally, with non-negative coefficients: iteratively
reweighted `perf_model.fit` (least squares on relative error, each row weighted by the inverse
square root of its last relative error, which converges to the least absolute errors;
`--objective squares` is the plain least-squares fit). The report is the MAPE per kind on the
held-out observations, stored in the profile's fit_mape as `heldout_<kind>` (and `train_<kind>`).

    kairos profile fit-splitwise --hardware a100-80gb --tp 4 --out common/profiles/a100-llama2-70b-tp4.json
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.errors import ConfigError
from common.perf_model import PerfModel, Profile, StepSample, fit, save_profile

DATA = Path(__file__).resolve().parent.parent / "data" / "splitwise" / "perf_model.csv"
KINDS = ("prefill", "batched_prefill", "decode")
GIB = 1024**3


@dataclass(frozen=True)
class Arch:
    """What the KV size and the memory budget need to know about a model."""

    layers: int
    kv_heads: int
    head_dim: int
    params: float  # weights, parameters
    dtype_bytes: int = 2  # fp16, as measured

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes  # K and V


@dataclass(frozen=True)
class Gpu:
    hbm_bytes: int
    hbm_bandwidth: float  # bytes/s, datasheet


ARCHS = {
    "llama2-70b": Arch(layers=80, kv_heads=8, head_dim=128, params=68.98e9),  # GQA: 8 KV heads of 64
    "bloom-176b": Arch(layers=70, kv_heads=112, head_dim=128, params=176.25e9),  # MHA
}
GPUS = {
    "a100-80gb": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=2.039e12),  # A100 SXM4 80GB, HBM2e
    "h100-80gb": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=3.35e12),  # H100 SXM5 80GB, HBM3
    "h100-80gb-pcap": Gpu(hbm_bytes=80 * GIB, hbm_bandwidth=3.35e12),  # power-capped H100
}


@dataclass(frozen=True)
class Obs:
    kind: str
    size: int  # the sort key of the hold-out rule
    label: str
    sample: StepSample
    repeats: int


def observations(model: str, hardware: str, tp: int, path: Path = DATA) -> list[Obs]:
    """The medians per configuration, as step samples, sorted by kind and size."""
    prefill: dict[tuple[int, int], list[float]] = defaultdict(list)
    decode: dict[tuple[int, int, int], list[float]] = defaultdict(list)
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] != model or r["hardware"] != hardware or int(r["tensor_parallel"]) != tp:
                continue
            L, B, out_len = int(r["prompt_size"]), int(r["batch_size"]), int(r["token_size"])
            prefill[(L, B)].append(float(r["prompt_time"]) / 1e3)  # prefill does not depend on out_len
            decode[(L, B, out_len)].append(float(r["token_time"]) / 1e3)
    if not prefill:
        raise ConfigError(f"no rows for model {model}, hardware {hardware}, tensor_parallel {tp} in {path}: "
                          f"see its README for the measured combinations")
    out: list[Obs] = []
    for (L, B), v in prefill.items():
        k = "prefill" if B == 1 else "batched_prefill"
        size = L if B == 1 else L * B
        out.append(Obs(k, size, f"{B}x{L}", StepSample(0, 0, [(L, 0)] * B, statistics.median(v)), len(v)))
    for (L, B, n), v in decode.items():
        out.append(Obs("decode", B * (L + n // 2), f"B{B} L{L} O{n}",
                       StepSample(B, B * (L + n // 2), [], statistics.median(v)), len(v)))
    out.sort(key=lambda o: (KINDS.index(o.kind), o.size, o.label))
    return out


def slower_than_sequential(obs: Sequence[Obs], tolerance: float = 0.05) -> list[Obs]:
    """Batched prefills that took longer than their prompts prefilled one after another (B x the
    single-prompt median, plus `tolerance`). Batching cannot be slower than running the prompts
    one at a time on the same engine; such a row measured something besides one step (the
    README notes outliers), and the fit leaves it out (its error is still reported)."""
    single = {o.sample.chunks[0][0]: o.sample.seconds for o in obs if o.kind == "prefill"}
    out = []
    for o in obs:
        if o.kind == "batched_prefill":
            L, B = o.sample.chunks[0][0], len(o.sample.chunks)
            if L in single and o.sample.seconds > B * single[L] * (1 + tolerance):
                out.append(o)
    return out


def split(obs: Sequence[Obs], every: int) -> tuple[list[Obs], list[Obs]]:
    """(train, held out): per kind, every `every`-th configuration by size from the second,
    never the first or the last."""
    train: list[Obs] = []
    held: list[Obs] = []
    for k in KINDS:
        group = [o for o in obs if o.kind == k]
        for i, o in enumerate(group):
            out = every > 0 and 0 < i < len(group) - 1 and (i - 1) % every == 0
            (held if out else train).append(o)
    return train, held


def kind_mape(model: PerfModel, obs: Sequence[Obs]) -> dict[str, float]:
    res: dict[str, float] = {}
    for k in KINDS:
        errs = [abs(model.step_time(o.sample.batch, o.sample.kv_tokens, o.sample.chunks) - o.sample.seconds)
                / o.sample.seconds for o in obs if o.kind == k]
        if errs:
            res[k] = sum(errs) / len(errs)
    return res


def kv_read_floor(arch: Arch, gpu: Gpu, tp: int) -> float:
    """Seconds per resident KV token a decode step must at least spend reading it from HBM."""
    return arch.kv_bytes_per_token / (tp * gpu.hbm_bandwidth)


KNEES = (128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
OBJECTIVES = ("mape", "squares")
IRLS_ROUNDS = 60  # reweighting rounds of the MAPE fit (it settles to 1e-4 of its MAPE within 60 on both GPUs)
IRLS_FLOOR = 1e-4  # relative error below which a row's weight stops growing (a row fitted exactly)


@dataclass(frozen=True)
class Fit:
    model: PerfModel
    report: dict[str, float]  # fit_mape: heldout_<kind>, train_<kind>, excluded_<kind>
    train: list[Obs]
    held: list[Obs]
    excluded: list[Obs]  # slower_than_sequential


def fit_splitwise(model: str, hardware: str, tp: int, *, every: int = 3, kv_read: str = "hbm",
                  objective: str = "mape", path: Path = DATA) -> Fit:
    """Fit on the training configurations (held-out and excluded ones left out).

    `objective`: "mape" minimises the mean absolute relative error over the training rows (the
    error the report gives; a row off the trend of its neighbours pulls the fit less than under
    squares), "squares" the mean squared relative error.

    a5 is 0 (the superlinearity of long prompts is their attention, a4); the roofline knee is the
    one of KNEES with the least weighted training error among those where a prefill step's fixed
    cost covers what the knee saves (a0 + a6 >= a7*knee: more equal chunks are never faster).
    `kv_read`: "fit" (the fitted a2, but never below what reading the KV from HBM takes) or
    "hbm" (a2 from the HBM bandwidth alone)."""
    if objective not in OBJECTIVES:
        raise ConfigError(f"unknown objective {objective!r}: one of {', '.join(OBJECTIVES)}")
    if model not in ARCHS or hardware not in GPUS:
        raise ConfigError(f"unknown model {model!r} or hardware {hardware!r}: models {sorted(ARCHS)}, "
                          f"hardware {sorted(GPUS)}")
    arch, gpu = ARCHS[model], GPUS[hardware]
    obs = observations(model, hardware, tp, path)
    dropped = slower_than_sequential(obs)
    train, held = split([o for o in obs if o not in dropped], every)
    weights = [1.0] * len(train)
    floor = kv_read_floor(arch, gpu, tp)
    samples = [o.sample for o in train]

    def rel(m: PerfModel) -> list[float]:
        return [abs(m.step_time(s.batch, s.kv_tokens, s.chunks) - s.seconds) / s.seconds for s in samples]

    def loss(m: PerfModel) -> float:
        p = 1 if objective == "mape" else 2
        return sum(w * e**p for w, e in zip(weights, rel(m), strict=True))

    def squares(knee: float, w: list[float]) -> PerfModel:
        fixed = {"a2": floor} if kv_read == "hbm" else {}
        m, _ = fit(samples, use_a5=False, fixed=fixed, weights=w, knee=knee)
        if m.a2 < floor:  # the data says less than HBM allows: the HBM floor instead
            m, _ = fit(samples, use_a5=False, fixed={"a2": floor}, weights=w, knee=knee)
        return m

    def one(knee: float) -> PerfModel:
        m = squares(knee, weights)
        if objective == "squares":
            return m
        # least absolute relative errors by iteratively reweighted least squares: weighting a
        # row's relative error e by 1/sqrt(|e|) of the last round makes its square |e|
        best, best_loss = m, loss(m)
        for _ in range(IRLS_ROUNDS):
            m = squares(knee, [w / max(e, IRLS_FLOOR) ** 0.5 for w, e in zip(weights, rel(m), strict=True)])
            if (cur := loss(m)) < best_loss:
                best, best_loss = m, cur
        return best

    fits = [one(k) for k in KNEES]
    ok = [m for m in fits if m.a0 + m.a6 >= m.a7 * m.knee] or [one(0.0)]
    best = min(ok, key=loss)
    report = {f"heldout_{k}": round(v, 4) for k, v in kind_mape(best, held).items()}
    report |= {f"train_{k}": round(v, 4) for k, v in kind_mape(best, train).items()}
    report |= {f"excluded_{k}": round(v, 4) for k, v in kind_mape(best, dropped).items()}
    return Fit(best, report, train, held, dropped)


# ------------------------------------------------------------------------------ the profile


@dataclass(frozen=True)
class Engine:
    """Engine limits of one instance; see `build_profile` for where each number comes from."""

    prefill_token_budget: int
    decode_token_budget: int
    decode_default_chunk: int
    max_batch: int = 256
    gpu_memory_utilization: float = 0.9  # vLLM's default share of HBM it may use
    reserve_per_gpu: int = 4 * GIB  # activations, CUDA graphs, NCCL buffers
    link_gbit: float = 200.0  # RDMA per prefill/decode instance pair
    link_efficiency: float = 0.8  # goodput of a large one-sided RDMA read
    xfer_t0: float = 0.005  # per transfer: notification, scheduling the pull, completion


ENGINES = {  # vLLM 0.32's OpenAI-server defaults: A100 2048 batched tokens, other >= 70 GiB GPUs 8192
    "a100-80gb": Engine(prefill_token_budget=2048, decode_token_budget=320, decode_default_chunk=192),
    "h100-80gb": Engine(prefill_token_budget=8192, decode_token_budget=768, decode_default_chunk=512),
    "h100-80gb-pcap": Engine(prefill_token_budget=8192, decode_token_budget=768, decode_default_chunk=512),
}


def kv_capacity(arch: Arch, gpu: Gpu, tp: int, eng: Engine) -> int:
    usable = tp * gpu.hbm_bytes * eng.gpu_memory_utilization - arch.params * arch.dtype_bytes - tp * eng.reserve_per_gpu
    if usable <= 0:
        raise ConfigError(f"the weights do not fit in {tp} GPUs of {gpu.hbm_bytes / GIB:.0f} GiB: use a larger --tp")
    return int(usable // arch.kv_bytes_per_token)


def build_profile(model: str, hardware: str, tp: int, *, every: int = 3, kv_read: str = "hbm",
                  objective: str = "mape", name: str = "", cmdline: str = "", path: Path = DATA) -> Profile:
    f = fit_splitwise(model, hardware, tp, every=every, kv_read=kv_read, objective=objective, path=path)
    m, report, train, held = f.model, f.report, f.train, f.held
    arch, gpu, eng = ARCHS[model], GPUS[hardware], ENGINES[hardware]
    kvb = arch.kv_bytes_per_token
    bw = eng.link_gbit * 1e9 / 8 * eng.link_efficiency
    m = PerfModel(a0=m.a0, a1=m.a1, a2=m.a2, a3=m.a3, a4=m.a4, a5=m.a5, a6=m.a6, a7=m.a7, knee=m.knee,
                  xfer_t0=eng.xfer_t0, xfer_bandwidth=bw, kv_bytes_per_token=kvb)
    cap = kv_capacity(arch, gpu, tp, eng)
    floor = kv_read_floor(arch, gpu, tp)
    held_txt = ", ".join(f"{o.kind} {o.label}" for o in held)
    mp = ", ".join(f"{k} {100 * report[f'heldout_{k}']:.1f} %" for k in KINDS if f"heldout_{k}" in report)
    fit_txt = ("least mean absolute relative error (MAPE; iteratively reweighted least squares)"
               if objective == "mape" else "least squares on relative error")
    ex = 2048
    mixed = m.step_time(32, 32 * 2048, [(eng.decode_default_chunk, 0)])
    excl = "".join(f" (their MAPE under this model: {100 * v:.1f} %)" for k, v in report.items()
                   if k.startswith("excluded_"))
    derivation = (
        f"Fitted by `{cmdline or 'kairos profile fit-splitwise'}` on {dt.date.today().isoformat()} to the measured "
        f"step times of {model} on {tp} x {hardware} (tensor parallel {tp}) in common/data/splitwise/perf_model.csv "
        f"(SplitwiseSim's profiling database, MIT; medians over the repeats of each configuration). "
        f"Observations: {sum(o.kind == 'prefill' for o in train + held)} prompt lengths (one prompt alone: one step of "
        f"T = L tokens), {sum(o.kind == 'batched_prefill' for o in train + held)} batches of 512-token prompts "
        f"(one step of T = 512 B tokens, each prompt attending over itself), "
        f"{sum(o.kind == 'decode' for o in train + held)} decode runs (B sequences at mean context L + O/2). "
        f"Held out of the fit (one configuration in {every} of each kind by size, never the smallest or largest): "
        f"{held_txt}. Held-out MAPE: {mp}. "
        f"Left out of the fit as slower than their prompts prefilled one at a time (see slower_than_sequential): "
        f"{', '.join(o.label for o in f.excluded) or 'none'}{excl}. "
        f"Fit: {fit_txt} over the training observations, a5 = 0, non-negative coefficients, the roofline knee "
        f"({m.knee:g} tokens) the best of {list(KNEES)} on the training rows among those with a0 + a6 >= a7*knee. "
        f"a2 (decode KV reads) is not identified by the data (a decode at B = 1 takes the same time at 128 and "
        f"8192 tokens of context, within its noise): it is set from the architecture and HBM, "
        f"{kvb} B/token / ({tp} x {gpu.hbm_bandwidth / 1e12:.2f} TB/s) = {floor * 1e9:.1f} ns per KV token. "
        f"Mixed steps (a chunk beside decodes) are not in the data: they are composed as common/perf_model.py "
        f"states (one fixed cost, GEMM terms over the step's total tokens, the decodes' and the chunks' own terms). "
        f"KV: 2 (K, V) x {arch.layers} layers x {arch.kv_heads} KV heads x {arch.head_dim} x {arch.dtype_bytes} B "
        f"= {kvb} B per token. Transfer: one {eng.link_gbit:g} Gb/s RDMA link per prefill/decode instance pair at "
        f"{eng.link_efficiency:.0%} goodput ({bw / 1e9:g} GB/s) plus {eng.xfer_t0 * 1e3:g} ms per transfer "
        f"(assumed, not measured): a {ex}-token prompt's KV ({kvb * ex / 1e9:.2f} GB) takes "
        f"{1e3 * m.xfer_time(ex):.0f} ms. KV capacity: {tp} x {gpu.hbm_bytes / GIB:g} GiB x "
        f"{eng.gpu_memory_utilization} (vLLM's gpu_memory_utilization) - {arch.params * arch.dtype_bytes / 1e9:.0f} GB "
        f"of fp16 weights - {tp} x {eng.reserve_per_gpu / GIB:g} GiB (activations, CUDA graphs, NCCL) = {cap} tokens. "
        f"Token budgets: prefill {eng.prefill_token_budget} (vLLM 0.32's OpenAI-server default on this GPU); decode "
        f"{eng.decode_token_budget} with default chunk {eng.decode_default_chunk}, so that a mixed step with 32 "
        f"decodes at 2048 tokens of context and a default chunk takes {1e3 * mixed:.0f} ms "
        f"({'within' if mixed <= 0.09 else 'above'} 0.9 x a 100 ms TBT SLO). "
        f"max_batch {eng.max_batch}: the data measures decode batches up to 64, larger ones "
        f"are extrapolated.")
    desc = (f"{model} on {tp} x {hardware} (tensor parallel {tp}), fitted to measured step times "
            f"(Splitwise profiling data); held-out MAPE {mp}.")
    return Profile(name=name or f"{hardware.split('-')[0]}-{model.replace('-', '')}-tp{tp}", description=desc,
                   derivation=derivation, model=m, prefill_token_budget=eng.prefill_token_budget,
                   decode_token_budget=eng.decode_token_budget, decode_default_chunk=eng.decode_default_chunk,
                   kv_capacity_tokens=cap, max_batch=eng.max_batch, fit_mape=report)


def print_report(profile: Profile, held: Sequence[Obs], excluded: Sequence[Obs] = ()) -> None:
    m = profile.model
    print(f"{profile.name}: a0 {m.a0 * 1e3:.2f} ms, a6 {m.a6 * 1e3:.2f} ms (prefill step), "
          f"a3 {m.a3 * 1e6:.1f} us/token, a7 {m.a7 * 1e6:.1f} us/token above {m.knee:g} tokens, "
          f"a1 {m.a1 * 1e6:.1f} us/decode, "
          f"a2 {m.a2 * 1e9:.1f} ns/KV token, a4 {m.a4 * 1e9:.2f} ns/(token x context)")
    print(f"{'held out':<34}{'measured ms':>12}{'model ms':>10}{'error':>8}")
    for o in [*held, *excluded]:
        if o is (excluded[0] if excluded else None):
            print("excluded from the fit (slower than sequential):")
        t = m.step_time(o.sample.batch, o.sample.kv_tokens, o.sample.chunks)
        print(f"{o.kind + ' ' + o.label:<34}{o.sample.seconds * 1e3:>12.1f}{t * 1e3:>10.1f}"
              f"{100 * (t - o.sample.seconds) / o.sample.seconds:>+7.1f}%")
    for k in KINDS:
        if f"heldout_{k}" in profile.fit_mape:
            print(f"MAPE {k:<16} held out {100 * profile.fit_mape[f'heldout_{k}']:5.1f} %   "
                  f"train {100 * profile.fit_mape[f'train_{k}']:5.1f} %")
        if f"excluded_{k}" in profile.fit_mape:
            print(f"MAPE {k:<16} excluded {100 * profile.fit_mape[f'excluded_{k}']:5.1f} %")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kairos profile fit-splitwise",
                                description="Fit a profile to the measured Splitwise step times "
                                            "(common/data/splitwise) and report its error on configurations "
                                            "held out of the fit.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="llama2-70b", choices=sorted(ARCHS))
    p.add_argument("--hardware", default="h100-80gb", choices=sorted(GPUS))
    p.add_argument("--tp", type=int, default=4, help="tensor-parallel degree (GPUs per instance)")
    p.add_argument("--holdout-every", type=int, default=3,
                   help="hold out every k-th configuration of each kind (0: none; the report is then training error)")
    p.add_argument("--kv-read", choices=("hbm", "fit"), default="hbm",
                   help="decode KV-read cost a2: from the HBM bandwidth, or fitted (never below HBM)")
    p.add_argument("--objective", choices=OBJECTIVES, default="mape",
                   help="minimise the mean absolute relative error (mape) or the mean squared one (squares)")
    p.add_argument("--csv", default=str(DATA), help="the measurements")
    p.add_argument("--name", default="", help="profile name (default: the --out file's stem)")
    p.add_argument("--out", required=True, help="profile JSON to write")
    args = p.parse_args(argv)
    shown = ["kairos profile fit-splitwise", f"--hardware {args.hardware}", f"--tp {args.tp}"]
    if args.model != "llama2-70b":
        shown.insert(1, f"--model {args.model}")
    if args.holdout_every != 3:
        shown.append(f"--holdout-every {args.holdout_every}")
    if args.kv_read != "hbm":
        shown.append(f"--kv-read {args.kv_read}")
    if args.objective != "mape":
        shown.append(f"--objective {args.objective}")
    shown.append(f"--out {args.out}")
    prof = build_profile(args.model, args.hardware, args.tp, every=args.holdout_every, kv_read=args.kv_read,
                         objective=args.objective, name=args.name or Path(args.out).stem, cmdline=" ".join(shown),
                         path=Path(args.csv))
    f = fit_splitwise(args.model, args.hardware, args.tp, every=args.holdout_every, kv_read=args.kv_read,
                      objective=args.objective, path=Path(args.csv))
    save_profile(prof, Path(args.out))
    print_report(prof, f.held, f.excluded)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

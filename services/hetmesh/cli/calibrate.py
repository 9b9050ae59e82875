"""`hetmesh calibrate`: efficiency factors for the cost model, as a file that `[costmodel] efficiency`,
`hetmesh plan --efficiency` and the simulator load (keys "<accelerator>/<model>").

- From a live mesh (--nats, else the mesh `hetmesh status` would ask): the factors the scheduler learned
  online from its workers' engine steps, one entry per (accelerator, model), the workers of a kind pooled
  (weighted by the steps each was fitted on).
- Offline (--engine vllm --model PATH --accelerator ID): one vLLM engine runs a grid of prefill, decode and
  mixed steps; each step's shape and wall time come from the engine's own step log; the factors are fitted by
  least squares (hetmesh.costmodel.calibrate) and shown as a table and a PNG of predicted against measured.

An existing output file keeps its other entries.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table


class CalibrateError(Exception):
    """What went wrong, in one line."""


def add_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="fit the cost model's efficiency factors: from a live mesh or one engine",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nats", help="NATS URL of a live mesh (default: as `hetmesh status`)")
    p.add_argument("--cluster", help="cluster file to read mesh.nats_url from")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds to wait for NATS and the scheduler")
    p.add_argument("--engine", choices=["vllm"], help="offline: run this engine through a grid of steps")
    p.add_argument("--model", help="offline: the HF model folder the engine serves")
    p.add_argument("--accelerator", help="offline: the catalog id of the chip it runs on (the file's key)")
    p.add_argument("--dtype", default="auto", help="offline: the engine's dtype (default auto)")
    p.add_argument("--max-len", type=int, default=2048, help="offline: longest prompt + output (default 2048)")
    p.add_argument("--grid", choices=["small", "full"], default="small",
                   help="offline: how many shapes (small: a few minutes on a small CPU)")
    p.add_argument("--out", default="efficiency.json", help="efficiency file to write (default efficiency.json)")
    p.add_argument("--png", help="offline: predicted-vs-measured plot (default: --out with .png)")


def run(args: argparse.Namespace) -> int:
    try:
        if args.engine:
            offline(args)
        else:
            from_mesh(args)
    except CalibrateError as e:
        print(f"hetmesh calibrate: {e}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------ the file
def write(out: str, entries: dict[str, Any], extra: dict[str, dict[str, object]], note: str) -> None:
    """Merge `entries` into `out` (created if missing; a corrupt one is an error, not overwritten)."""
    from hetmesh.costmodel.efficiency import EfficiencyFileError, load_efficiencies, save_efficiencies

    effs: dict[str, Any] = {}
    if Path(out).exists():
        try:
            effs = load_efficiencies(out)
        except EfficiencyFileError as e:
            raise CalibrateError(f"not overwriting {e}") from None
    effs.update(entries)
    try:
        save_efficiencies(out, effs, note=note, extra=extra)
    except OSError as e:
        raise CalibrateError(f"cannot write {out}: {e.strerror or e}") from None


# ------------------------------------------------------------------ from a live mesh
def from_mesh(args: argparse.Namespace) -> None:
    import nats.errors

    from hetmesh import subjects
    from hetmesh.cli.mesh import fetch_status, nats_url
    from hetmesh.costmodel.learn import pooled

    url = nats_url(args.nats, args.cluster)
    try:
        status = asyncio.run(fetch_status(url, args.timeout))
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        raise CalibrateError(f"no scheduler answered on {subjects.SCHED_STATUS} at {url}") from None
    except TimeoutError:
        raise CalibrateError(f"cannot reach NATS at {url}: no answer within {args.timeout * 2:g}s") from None
    except (OSError, nats.errors.Error) as exc:
        raise CalibrateError(f"cannot reach NATS at {url}: {exc or type(exc).__name__}") from None
    pools = pooled(status.details)
    if not pools:
        raise CalibrateError(f"no worker at {url} has reported engine steps yet (is the scheduler's cost policy "
                             "learning, and has the mesh served requests?)")
    t = Table(title=f"learned by scheduler {status.instance} at {url}")
    for col in ("key", "workers", "steps", "compute", "memory", "overhead ms", "per seq ms"):
        t.add_column(col, justify="left" if col in ("key", "workers") else "right")
    for key, (e, n, ws) in pools.items():
        t.add_row(key, ", ".join(ws), str(n), f"{e.compute:.3g}", f"{e.memory:.3g}", f"{e.overhead_s * 1e3:.2f}",
                  f"{e.per_seq_s * 1e3:.3f}")
    Console(width=160).print(t)
    write(args.out, {k: v[0] for k, v in pools.items()},
          {k: {"samples": v[1]} for k, v in pools.items()}, note=f"learned online by the scheduler at {url}")
    print(f"wrote {len(pools)} entr{'y' if len(pools) == 1 else 'ies'} to {args.out}")


# ------------------------------------------------------------------ offline: one engine, a grid of steps
@dataclass(frozen=True)
class Shape:
    """One grid point: `prefill` prompts of `length` tokens alone, or `decode` sequences at `length` tokens of
    context, or both at once (mixed: a prefill of `length` tokens beside `decode` sequences at 512)."""

    kind: str  # prefill | decode | mixed
    batch: int
    length: int

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.batch} x {self.length}"
        if self.kind == "decode":
            return f"decode {self.batch} @ {self.length}"
        return f"mixed: prefill {self.length} + decode {self.batch} @ {MIXED_CONTEXT}"


MIXED_CONTEXT = 512
DECODE_STEPS = 12
REPEATS = 3  # runs of a prefill or mixed shape (one step each); the median step is kept


def grid(size: str, max_len: int) -> list[Shape]:
    lens = [32, 128, 512, 1024, 2048] if size == "full" else [32, 256, 1024]
    lens = [n for n in lens if n + DECODE_STEPS + 2 <= max_len] or [max(8, max_len // 2)]
    pre = [Shape("prefill", b, n) for n in lens for b in ((1, 4) if size == "full" else (1, 2)) if b * n <= 8192]
    dec = [Shape("decode", b, n) for n in lens for b in ((1, 4, 8) if size == "full" else (1, 4))]
    mix = [Shape("mixed", b, n) for n in lens[-2:] for b in (2, 4)]
    return pre + dec + mix


class Runner:
    """A started engine (hetmesh.engines.vllm_engine) and distinct random prompts (no prefix-cache hits)."""

    def __init__(self, engine: Any, vocab: int) -> None:
        self.engine = engine
        self.vocab = vocab
        self.rng = random.Random(0)
        self.n = 0

    def request(self, length: int, max_tokens: int) -> Any:
        from hetmesh.engines.base import EngineRequest
        from hetmesh.protocol import SamplingParams

        self.n += 1
        prompt = [self.rng.randrange(10, self.vocab) for _ in range(length)]
        return EngineRequest(request_id=f"cal-{self.n}", prompt_tokens=prompt, block_hashes=[],
                             sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    async def run(self, req: Any, started: asyncio.Event | None = None) -> None:
        await self.engine.submit(req)
        async for _out in self.engine.stream(req.request_id):
            if started is not None:
                started.set()

    async def shape(self, s: Shape) -> list[Any]:
        """Run `s`; the engine steps of its kind it took (StepSample)."""
        self.engine.step_log()  # what came before is not this shape's
        if s.kind == "prefill":
            for _ in range(REPEATS):  # one step each: a few, for a median
                await asyncio.gather(*(self.run(self.request(s.length, 1)) for _ in range(s.batch)))
        elif s.kind == "decode":
            await asyncio.gather(*(self.run(self.request(s.length, DECODE_STEPS + 1)) for _ in range(s.batch)))
        else:
            evs = [asyncio.Event() for _ in range(s.batch)]
            decs = [asyncio.create_task(self.run(self.request(MIXED_CONTEXT, 8 * DECODE_STEPS), e)) for e in evs]
            await asyncio.gather(*(e.wait() for e in evs))
            for _ in range(REPEATS):
                await self.run(self.request(s.length, 1))
            await asyncio.gather(*decs)
        await asyncio.sleep(0.1)  # the last step is recorded right after its outputs are handed out
        steps = self.engine.step_log()
        if s.kind == "prefill":
            return [x for x in steps if x.prefill_tokens and not x.n_decode]
        if s.kind == "decode":
            return [x for x in steps if x.n_decode == s.batch and not x.prefill_tokens]
        return [x for x in steps if x.prefill_tokens and x.n_decode]


def representative(steps: Sequence[Any]) -> Any | None:
    """The step of median time among `steps` (one step's shape and time, not a mix of several)."""
    if not steps:
        return None
    med = statistics.median_low([x.seconds for x in steps])
    return next(x for x in steps if x.seconds == med)


async def measure(model: str, accelerator: str, args: argparse.Namespace) -> list[tuple[Shape, Any]]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from hetmesh.engines.base import EngineError
    from hetmesh.engines.vllm_engine import VllmConfig, VllmEngine

    shapes = grid(args.grid, args.max_len)
    vocab = _vocab(model)
    cfg = VllmConfig(model_dir=model, model_name="calibrate", max_model_len=args.max_len, dtype=args.dtype,
                     max_batch=max(8, max(s.batch for s in shapes)), kv_connector="")
    engine = VllmEngine(cfg)
    got: list[tuple[Shape, Any]] = []
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as prog:
        task = prog.add_task("starting the engine", total=len(shapes) + 1)
        try:
            await engine.start()
        except EngineError as e:
            raise CalibrateError(f"the vllm engine did not start: {e}") from None
        prog.advance(task)
        try:
            r = Runner(engine, vocab)
            await r.shape(Shape("decode", 1, 64))  # warm-up, not measured
            for s in shapes:
                prog.update(task, description=s.label)
                rep = representative(await r.shape(s))
                if rep is not None:
                    got.append((s, rep))
                prog.advance(task)
        finally:
            await engine.close()
    return got


def _vocab(model: str) -> int:
    import json

    try:
        return int(json.loads((Path(model) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError) as e:
        raise CalibrateError(f"{model}/config.json: cannot read vocab_size: {e}") from None


def offline(args: argparse.Namespace) -> None:
    if not args.model or not args.accelerator:
        raise CalibrateError("--engine needs --model PATH and --accelerator ID")
    from hetmesh.costmodel import CostModel, accelerator, model_spec
    from hetmesh.costmodel.calibrate import Sample, calibrate

    try:
        chip = accelerator(args.accelerator)
        spec = model_spec(args.model)
    except (KeyError, ValueError, OSError) as e:
        raise CalibrateError(str(e).strip("'\"")) from None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    got = asyncio.run(measure(str(Path(args.model).resolve()), args.accelerator, args))
    if len(got) < 4:
        raise CalibrateError(f"only {len(got)} grid shapes produced steps: too few to fit")
    samples = [Sample.of_step(x) for _, x in got]
    eff = calibrate(CostModel(chip, spec), samples, fit_per_seq=True)
    fitted = CostModel(chip, spec, efficiency=eff)
    pred = [fitted.step_time(s.prefills, s.decode_contexts) for s in samples]
    t = Table(title=f"{args.engine} on {args.accelerator}, model {spec.name}: {eff.compute:.3g} compute, "
                    f"{eff.memory:.3g} memory, {eff.overhead_s * 1e3:.2f} ms/step, {eff.per_seq_s * 1e3:.3f} ms/seq")
    for col in ("shape", "measured ms", "predicted ms", "error"):
        t.add_column(col, justify="left" if col == "shape" else "right")
    for (shape, x), p in zip(got, pred, strict=True):
        t.add_row(shape.label, f"{x.seconds * 1e3:.2f}", f"{p * 1e3:.2f}", f"{(p / x.seconds - 1) * 100:+.1f}%")
    Console(width=160).print(t)
    errs = [abs(p / s.seconds - 1) for p, s in zip(pred, samples, strict=True)]
    key = f"{args.accelerator}/{spec.name}"
    write(args.out, {key: eff}, {key: {"samples": len(samples)}},
          note=f"hetmesh calibrate --engine {args.engine}: {len(samples)} grid shapes")
    png = args.png or str(Path(args.out).with_suffix(".png"))
    plot(png, got, pred, key)
    print(f"{key}: median |error| {statistics.median(errs) * 100:.1f}%, max {max(errs) * 100:.1f}% over "
          f"{len(samples)} shapes -> {args.out}, {png}")


def plot(png: str, got: Sequence[tuple[Shape, Any]], pred: Sequence[float], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 5))
    for kind, marker in (("prefill", "o"), ("decode", "s"), ("mixed", "^")):
        pts = [(x.seconds * 1e3, p * 1e3) for (s, x), p in zip(got, pred, strict=True) if s.kind == kind]
        if pts:
            ax.scatter(*zip(*pts, strict=True), marker=marker, label=kind)
    lo = min(min(x.seconds for _, x in got), min(pred)) * 1e3 * 0.8
    hi = max(max(x.seconds for _, x in got), max(pred)) * 1e3 * 1.25
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="predicted = measured")
    ax.set(xscale="log", yscale="log", xlabel="measured step (ms)", ylabel="predicted step (ms)", title=title)
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    for axis in (ax.xaxis, ax.yaxis):  # plain numbers, major ticks only (minor labels overlap on a log axis)
        axis.set_major_formatter(ScalarFormatter())
        axis.set_minor_formatter(NullFormatter())
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(png, dpi=120)
    except OSError as e:
        raise CalibrateError(f"cannot write {png}: {e.strerror or e}") from None
    finally:
        plt.close(fig)

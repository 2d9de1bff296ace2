"""The INT8 gate: an INT8 trunk is served where it gives the answers the float trunk gives.

Judged on held-out images (ones the calibration never saw), from their features under both
trunks (`HeldOut`, kept with the INT8 trunk: `backbone.quantize.Int8Artifact`), so a head
registered later is scored at once, with one matmul per trunk (`agreement`):

  - every head's top-1 class is the same under both trunks on >= `MIN_HEAD_AGREEMENT` of the
    images;
  - over all heads' answers together, on >= `MIN_OVERALL_AGREEMENT` of them;
  - the features' mean cosine with the float trunk's is >= `MIN_MEAN_COSINE`.

The minimum cosine and the images of lowest cosine stay in the report (they say which pictures
lose the most to the static 8-bit ranges) but do not gate: one flat picture's features are
small, so the same absolute error is a large angle on it, and its answers did not change.
Without a registered head the mean cosine alone decides, and the report says so.

Pure numpy: nothing here knows bots, stores, OpenVINO or NNCF.
"""
from __future__ import annotations

import io
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace

import numpy as np

from backbone.spec import FEATURE_DIM

# The bounds (issue 31). Published INT8 post-training quantization of Inception-V4 loses
# 0.06-0.09 points of ImageNet top-1 (OpenVINO's accuracy tables, Intel Neural Compressor): a
# faithful INT8 trunk changes well under 1 % of a trained head's answers. With the 100
# held-out images of `multihead quantize`, 99 % per head tolerates one changed answer per
# head, and 99.5 % over all heads' answers half of that on average, so one head cannot pass
# on the others' luck, nor many heads each at their limit.
MIN_HEAD_AGREEMENT = 0.99
MIN_OVERALL_AGREEMENT = 0.995
# The mean, not the minimum: the demo's INT8 trunk (seeded random trunk, 100 held-out demo
# images) had mean cosine 0.99962 on an AVX2 CPU, its minimum 0.99881 on one nearly flat grey
# picture whose features are 0.10 x the median norm (docs/performance.md, "Why the demo's INT8
# trunk misses the cosine bound"); keeping half of the net in float did not lift that one image
# to 0.999, and no head's answer on it changed. An INT8 trunk whose mean falls below 0.999 is
# off on every image, not on one. And cosines do not decide alone: on an AMD EPYC with VNNI
# the demo's INT8 trunk had mean 0.999622, yet changed 15 % of its trained bots' answers
# (docs/performance.md, "The INT8 gate on the demo").
MIN_MEAN_COSINE = 0.999
LOWEST_SHOWN = 3  # images of lowest cosine the report names
FAILURES_SHOWN = 3  # failing heads a one-line summary names (the rest counted)
# Feature norm (÷ the median held-out image's) below / above which the report says why an
# image's cosine is the lowest (`why_lowest`).
LOW_NORM = 0.25
HIGH_NORM = 1.5


# -- the held-out images' features -----------------------------------------------------------

@dataclass(frozen=True, eq=False)
class HeldOut:
    """The features of the held-out images under the float and the INT8 trunk.

    Attributes:
      names: the images' names (their paths under the calibration folder).
      fp32: float32 [N, 1536], the float trunk's features.
      int8: float32 [N, 1536], the INT8 trunk's, same images in the same order.
    """

    names: tuple[str, ...]
    fp32: np.ndarray
    int8: np.ndarray

    def __post_init__(self) -> None:
        a = np.ascontiguousarray(self.fp32, np.float32)
        b = np.ascontiguousarray(self.int8, np.float32)
        if a.shape != b.shape or a.ndim != 2 or a.shape[1] != FEATURE_DIM or not len(a):
            raise ValueError(f"features must both be [N>=1, {FEATURE_DIM}], got "
                             f"{list(np.shape(self.fp32))} and {list(np.shape(self.int8))}")
        names = tuple(str(name) for name in self.names)
        if len(names) != len(a):
            raise ValueError(f"{len(names)} names for {len(a)} images")
        object.__setattr__(self, "names", names)
        object.__setattr__(self, "fp32", a)
        object.__setattr__(self, "int8", b)

    @property
    def images(self) -> int:
        return len(self.names)

    def to_bytes(self) -> bytes:
        """An `.npz` of the features and names (no pickled objects)."""
        buffer = io.BytesIO()
        np.savez(buffer, fp32=self.fp32, int8=self.int8, names=np.array(self.names, dtype=str))
        return buffer.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> HeldOut:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            return cls(tuple(npz["names"].tolist()), npz["fp32"], npz["int8"])


def cosines(fp32: np.ndarray, int8: np.ndarray) -> np.ndarray:
    """Each image's cosine between its two feature vectors [N] (two all-zero vectors: 1; one
    zero vector against another: -1)."""
    a = np.asarray(fp32, np.float64)  # [N, 1536]
    b = np.asarray(int8, np.float64)  # [N, 1536]
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)  # [N]
    both_zero = ~a.any(axis=1) & ~b.any(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cosine = np.where(both_zero, 1.0, (a * b).sum(axis=1) / norms)  # [N]
    return np.nan_to_num(cosine, nan=-1.0)


def agreement(held_out: HeldOut, weights: np.ndarray, biases: np.ndarray) -> float:
    """The share of the held-out images whose top-1 class under a head (weights [1536, n],
    biases [n]) is the same with the INT8 trunk's features as with the float trunk's: one
    matmul per trunk."""
    w = np.asarray(weights, np.float32)
    b = np.asarray(biases, np.float32)
    if w.ndim != 2 or w.shape[0] != FEATURE_DIM or b.shape != (w.shape[1],):
        raise ValueError(f"a head is weights [{FEATURE_DIM}, n] and biases [n], got "
                         f"{list(w.shape)} and {list(b.shape)}")
    top_fp32 = (held_out.fp32 @ w + b).argmax(axis=1)  # [N]
    top_int8 = (held_out.int8 @ w + b).argmax(axis=1)  # [N]
    return float(np.mean(top_fp32 == top_int8))


# -- the report ------------------------------------------------------------------------------

def percent(share: float) -> str:
    """A share for people: 0.975 -> "97.50 %"."""
    return f"{100 * share:.2f} %"


def bound_percent(share: float) -> str:
    """A bound for people: 0.99 -> "99 %", 0.995 -> "99.5 %"."""
    return f"{100 * share:g} %"


@dataclass(frozen=True)
class FidelityReport:
    """The gate of an INT8 trunk: its features against the float trunk's on held-out images.

    Attributes:
      images: how many held-out images were compared.
      mean_cosine: the mean over the images of their features' cosine (gated).
      min_cosine: the smallest (reported, not gated).
      agreement: head name -> share of the images whose top-1 class is the same.
      lowest: the LOWEST_SHOWN images of lowest cosine, lowest first: {"image": name,
        "cosine": ..., "norm_ratio": its fp32 feature norm / the median image's}.
      min_agreement_bound, overall_agreement_bound, mean_cosine_bound: the bounds in force
        when it was judged.
    """

    images: int
    mean_cosine: float
    min_cosine: float
    agreement: dict[str, float] = field(default_factory=dict)
    lowest: list[dict] = field(default_factory=list)
    min_agreement_bound: float = MIN_HEAD_AGREEMENT
    overall_agreement_bound: float = MIN_OVERALL_AGREEMENT
    mean_cosine_bound: float = MIN_MEAN_COSINE

    @property
    def overall_agreement(self) -> float | None:
        """The share of all heads' answers that agree (every head answers every image: the
        mean of the heads' shares); None without a head."""
        if not self.agreement:
            return None
        return float(np.mean(list(self.agreement.values())))

    @property
    def lowest_head(self) -> tuple[str, float] | None:
        """(name, agreement) of the head that agrees least (ties: by name); None without one."""
        if not self.agreement:
            return None
        name = min(self.agreement, key=lambda k: (self.agreement[k], k))
        return name, self.agreement[name]

    def failing_heads(self) -> list[tuple[str, float]]:
        """(name, agreement) of the heads below the bound, lowest first."""
        return sorted(((name, value) for name, value in self.agreement.items()
                       if not value >= self.min_agreement_bound),  # NaN fails
                      key=lambda pair: (pair[1], pair[0]))

    @property
    def failures(self) -> list[str]:
        """One phrase per bound not met (empty: the INT8 trunk passes), each naming what
        failed and its figure against the bound."""
        out = [f"head {name!r} (agreement {percent(value)} < "
               f"{bound_percent(self.min_agreement_bound)})"
               for name, value in self.failing_heads()]
        overall = self.overall_agreement
        if overall is not None and not overall >= self.overall_agreement_bound:
            out.append(f"all heads' answers (agreement {percent(overall)} < "
                       f"{bound_percent(self.overall_agreement_bound)})")
        if not self.mean_cosine >= self.mean_cosine_bound:
            out.append(f"mean cosine ({self.mean_cosine:.6f} < {self.mean_cosine_bound})")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures

    def for_heads(self, agreement: Mapping[str, float]) -> FidelityReport:
        """The same INT8 trunk judged for other heads (the cosines do not depend on them),
        against this module's bounds as they are now."""
        return replace(self, agreement={str(k): float(v) for k, v in agreement.items()},
                       min_agreement_bound=MIN_HEAD_AGREEMENT,
                       overall_agreement_bound=MIN_OVERALL_AGREEMENT,
                       mean_cosine_bound=MIN_MEAN_COSINE)

    def summary(self) -> str:
        """The gate in one line: "gate passed for 3 heads (min agreement 100.00 %, overall
        100.00 %, mean cosine 0.9995)", "gate passed with no registered head (mean cosine
        0.9995)" or "gate fails for head 'x' (agreement 97.50 % < 99 %)"."""
        if self.passed:
            if not self.agreement:
                return f"gate passed with no registered head (mean cosine {self.mean_cosine:.4f})"
            n = len(self.agreement)
            return (f"gate passed for {n} head{'s' if n != 1 else ''} (min agreement "
                    f"{percent(self.lowest_head[1])}, overall {percent(self.overall_agreement)}, "
                    f"mean cosine {self.mean_cosine:.4f})")
        failures = self.failures
        heads = len(self.failing_heads())
        shown = failures[:FAILURES_SHOWN] + failures[heads:] if heads > FAILURES_SHOWN \
            else failures
        more = f" and {heads - FAILURES_SHOWN} more heads" if heads > FAILURES_SHOWN else ""
        return f"gate fails for {'; '.join(shown)}{more}"

    def lines(self) -> list[str]:
        """The report for people, one line per measure."""
        out = [f"held-out images: {self.images}",
               f"mean cosine vs fp32: {self.mean_cosine:.6f} (bound >= {self.mean_cosine_bound})",
               f"min cosine vs fp32: {self.min_cosine:.6f} (reported, not gated)"]
        if self.lowest:
            out.append("lowest cosines: " + ", ".join(
                f"{row['image']} {row['cosine']:.6f} (features {row['norm_ratio']:.2f} x the "
                f"median norm)" for row in self.lowest))
            hint = why_lowest(self.lowest[0]["norm_ratio"])
            if hint and not self.lowest[0]["cosine"] >= self.mean_cosine_bound:
                out.append(f"  {self.lowest[0]['image']}: {hint}")
        if not self.agreement:
            out.append("top-1 agreement: no registered head (the mean cosine alone decides)")
        else:
            out += [f"top-1 agreement {name}: {percent(value)} (bound >= "
                    f"{bound_percent(self.min_agreement_bound)})"
                    for name, value in sorted(self.agreement.items())]
            n = len(self.agreement)
            out.append(f"top-1 agreement over all heads' answers ({n} head"
                       f"{'s' if n != 1 else ''}): {percent(self.overall_agreement)} (bound >= "
                       f"{bound_percent(self.overall_agreement_bound)})")
        out.append("PASS" if self.passed else "FAIL: " + "; ".join(self.failures))
        return out

    def to_dict(self) -> dict:
        return {**asdict(self), "overall_agreement": self.overall_agreement,
                "passed": self.passed}

    @classmethod
    def from_dict(cls, data: Mapping) -> FidelityReport:
        """From `to_dict`'s output (derived fields ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def why_lowest(norm_ratio: float) -> str | None:
    """What an image's feature norm (÷ the median image's) says about its int8 error: the
    activation ranges are static (set on the calibration images), so every image gets about
    the same absolute error, large on small features; and a larger image's activations beyond
    the ranges are clipped. Measured on the demo images: a flat grey picture (features 0.10 x
    the median) and bright snow scenes (1.8 x) were the lowest; docs/performance.md."""
    if norm_ratio < LOW_NORM:
        return ("a low-signal picture (flat, low-contrast): the int8 trunk's static activation "
                "ranges add about the same absolute error to every image, a large share of "
                "small features")
    if norm_ratio > HIGH_NORM:
        return ("stronger activations than most calibration images: clipped by the ranges "
                "they set")
    return None


def judge(held_out: HeldOut, agreement: Mapping[str, float] | None = None) -> FidelityReport:
    """The gate of an INT8 trunk from its held-out features and its heads' agreement (head
    name -> `agreement(...)`), against this module's bounds as they are at call time."""
    cosine = cosines(held_out.fp32, held_out.int8)  # [N]
    norm = np.linalg.norm(held_out.fp32.astype(np.float64), axis=1)  # [N]
    median = float(np.median(norm))
    lowest = [{"image": held_out.names[i], "cosine": float(cosine[i]),
               "norm_ratio": float(norm[i] / median) if median > 0 else 0.0}
              for i in np.argsort(cosine, kind="stable")[:LOWEST_SHOWN]]
    return FidelityReport(
        images=held_out.images, mean_cosine=float(cosine.mean()),
        min_cosine=float(cosine.min()),
        agreement={str(k): float(v) for k, v in (agreement or {}).items()}, lowest=lowest,
        min_agreement_bound=MIN_HEAD_AGREEMENT, overall_agreement_bound=MIN_OVERALL_AGREEMENT,
        mean_cosine_bound=MIN_MEAN_COSINE)


def fidelity(fp32_features: np.ndarray, int8_features: np.ndarray,
             heads: Mapping[str, object] | None = None,
             names: Sequence[str] | None = None) -> FidelityReport:
    """Judges int8 features against fp32 features of the same images.

    Args:
      fp32_features: float32 [N, 1536].
      int8_features: float32 [N, 1536], same images in the same order.
      heads: name -> a head with `weights` [1536, n] and `biases` [n] (a `heads.Head`).
      names: the images' names for the report's lowest cosines (default: "#0", "#1", ...).
    """
    count = len(np.asarray(fp32_features))
    held_out = HeldOut(tuple(names) if names is not None else tuple(f"#{i}" for i in
                                                                      range(count)),
                       fp32_features, int8_features)
    return judge(held_out, {name: agreement(held_out, head.weights, head.biases)
                            for name, head in (heads or {}).items()})


def score(report: FidelityReport) -> float:
    """The gate as one number for a search that keeps the fewest layers in float (NNCF's
    accuracy control): 1 - SCALE x the worst of the three shortfalls, each divided by what its
    bound allows, so that the float trunk scores 1 and an INT8 trunk scores >= 1 - SCALE
    exactly where its gate passes (`SCALE` is then NNCF's `max_drop`)."""
    worst = _shortfall(report.mean_cosine, report.mean_cosine_bound)
    if report.agreement:
        worst = max(worst, _shortfall(report.lowest_head[1], report.min_agreement_bound),
                    _shortfall(report.overall_agreement, report.overall_agreement_bound))
    return 1.0 - SCALE * worst


def _shortfall(value: float, bound: float) -> float:
    """How far `value` is from 1, in units of what `bound` allows (<= 1: within it)."""
    if bound < 1:
        return (1 - value) / (1 - bound)
    return 0.0 if value >= bound else float("inf")  # a bound of 1 or more allows nothing


SCALE = 1 - MIN_OVERALL_AGREEMENT  # `score`'s unit: any value in (0, 1) would do


__all__ = ["FAILURES_SHOWN", "HIGH_NORM", "LOWEST_SHOWN", "LOW_NORM", "MIN_HEAD_AGREEMENT",
           "MIN_MEAN_COSINE", "MIN_OVERALL_AGREEMENT", "SCALE", "FidelityReport", "HeldOut",
           "agreement", "bound_percent", "cosines", "fidelity", "judge", "percent", "score",
           "why_lowest"]

"""A bot's head: `weights [1536, n]`, `biases [n]` and n labels, applied with numpy.

Heads are data, not graph: the trunk produces `features [N, 1536]` once per batch and each bot's
head turns its rows into logits with one matmul. Nothing here imports TensorFlow.
"""
from __future__ import annotations

import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii

import numpy as np

from backbone.spec import FEATURE_DIM
from heads.errors import InvalidBotId, InvalidHead, InvalidLabel

# A head has at most this many classes (1536 x 100,000 float32 = 614 MB): uploads and files
# claiming more are refused before their tensors are read.
MAX_CLASSES = 100_000

_BOT_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def validate_bot_id(bot_id: object) -> str:
    """Return `bot_id` if it matches `[A-Za-z0-9][A-Za-z0-9._-]{0,63}`, else raise `InvalidBotId`.

    Ids become directory names in the store, so this is also the path-traversal guard.
    """
    if not isinstance(bot_id, str) or _BOT_ID_RE.fullmatch(bot_id) is None:
        shown = bot_id if isinstance(bot_id, str) else type(bot_id).__name__
        if isinstance(shown, str) and len(shown) > 80:
            shown = shown[:77] + "..."
        raise InvalidBotId(
            f"invalid bot id {shown!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit"
        )
    return bot_id


# The label rules of a new head version (`validate_labels`): at most MAX_LABEL_CHARS
# characters (code points), not empty, no surrounding whitespace, and none of _REFUSED:
#   Cc     the C0 and C1 controls (tab, newline, ESC and the ANSI sequences it starts, NEL...);
#   Zl Zp  U+2028 / U+2029: line and paragraph breaks (like NEL, they split a labels file);
#   Cs     lone surrogates: not text (UTF-8 cannot encode them);
#   the bidirectional formatting characters (U+061C, U+200E-U+200F, U+202A-U+202E,
#   U+2066-U+2069), which reorder how the text around them is displayed. Other format
#   characters (Cf) are allowed: the zero-width joiner of emoji sequences, the soft hyphen.
# A label is then at most 256 x 12 bytes as JSON text (a non-BMP character escapes to a
# surrogate pair, 12 bytes), and shows as itself in a terminal or a log line.
MAX_LABEL_CHARS = 256
_REFUSED = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff\u061c\u200e\u200f"
                      "\u202a-\u202e\u2066-\u2069]")
_SHOWN_CHARS = 40  # of a refused label, in an error message


def escape_text(text: str) -> str:
    """`text` safe to print to a terminal or a log line: a backslash doubled, and every
    character that is not printable (`str.isprintable`: controls, format characters, line and
    paragraph separators, surrogates, unassigned code points) written as `\\xNN`, `\\uNNNN` or
    `\\UNNNNNNNN`. Text a tenant chose (labels, sources) goes through this on its way to the
    operator's screen: it cannot move the cursor or start an ANSI escape sequence."""
    if text.isprintable() and "\\" not in text:
        return text
    out = []
    for c in text:
        if c == "\\":
            out.append("\\\\")
        elif c.isprintable():
            out.append(c)
        else:
            o = ord(c)
            out.append(f"\\x{o:02x}" if o < 0x100 else f"\\u{o:04x}" if o < 0x10000
                       else f"\\U{o:08x}")
    return "".join(out)


def _shown(label: str) -> str:
    """The start of a refused label, escaped, quoted: never the whole of a megabyte."""
    head = escape_text(label[:_SHOWN_CHARS])
    return f"'{head}...'" if len(label) > _SHOWN_CHARS else f"'{head}'"


def _refused_char(c: str) -> str:
    o = ord(c)
    if o < 0x20 or 0x7f <= o <= 0x9f:
        kind = "control character"
    elif c == "\u2028":
        kind = "line separator"
    elif c == "\u2029":
        kind = "paragraph separator"
    elif 0xd800 <= o <= 0xdfff:
        kind = "lone surrogate"
    else:
        kind = "bidirectional formatting character"
    return f"{kind} U+{o:04X}"


def validate_labels(labels: Iterable[object], *, source: str | None = None,
                    stored: bool = False) -> tuple[str, ...]:
    """Labels as a tuple of str, each following the label rules (above `MAX_LABEL_CHARS`).

    Args:
        source: where the labels come from, e.g. "labels file 'x.txt'": a refusal then names
            the line too (label i is on line i + 1).
        stored: labels of a version already in the store, read back: only what a head needs
            to load (str, not empty, no surrounding whitespace or line break), so a version
            registered before the length and character rules still loads and serves.
    Raises:
        InvalidLabel: naming the label (its index, its line) and what is wrong, showing at
            most its first 40 characters, escaped.
    """
    if isinstance(labels, (str, bytes)):
        raise InvalidHead("labels must be a sequence of strings, not a single string")
    out = []
    for i, label in enumerate(labels):
        where = f"label {i}" if source is None else f"label {i} (line {i + 1} of {source})"
        if not isinstance(label, str):
            raise InvalidLabel(f"{where} is {type(label).__name__}, not str")
        if not label.strip():
            raise InvalidLabel(f"{where} is empty")
        if stored:
            if label != label.strip() or "\n" in label or "\r" in label:
                raise InvalidLabel(f"{where} {_shown(label)} has surrounding whitespace or a "
                                   "line break")
            out.append(label)
            continue
        if len(label) > MAX_LABEL_CHARS:
            raise InvalidLabel(f"{where} {_shown(label)}: {len(label):,} characters, at most "
                               f"{MAX_LABEL_CHARS}")
        bad = _REFUSED.search(label)
        if bad is not None:
            line_break = " (a line break)" if bad.group() in "\n\r\x0b\x0c\x1c\x1d\x1e\x85" else ""
            raise InvalidLabel(f"{where} {_shown(label)}: {_refused_char(bad.group())}"
                               f"{line_break} at character {bad.start() + 1}")
        if label != label.strip():
            raise InvalidLabel(f"{where} {_shown(label)} has surrounding whitespace")
        out.append(label)
    return tuple(out)


def validate_head_arrays(
    weights: object, biases: object, labels: Iterable[object]
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """Check and normalise a head: `weights [1536, n]`, `biases [n]`, n >= 2 labels, all finite.

    Returns:
        C-contiguous float32 copies of weights and biases, and the labels as a tuple.
    Raises:
        InvalidHead: naming the offending shape, count or value.
    """
    try:
        with np.errstate(over="ignore"):  # overflow to inf is reported just below
            w = np.array(weights, dtype=np.float32, order="C", copy=True)  # [1536, n]
            b = np.array(biases, dtype=np.float32, order="C", copy=True)  # [n]
    except (TypeError, ValueError) as exc:
        raise InvalidHead(f"weights and biases must be numeric arrays ({exc})") from None
    if w.ndim != 2 or w.shape[0] != FEATURE_DIM:
        raise InvalidHead(f"weights have shape {list(w.shape)}, expected [{FEATURE_DIM}, n]")
    n = w.shape[1]
    if n < 2:
        raise InvalidHead(f"a head needs at least 2 classes, weights have {n}")
    if n > MAX_CLASSES:
        raise InvalidHead(f"a head has at most {MAX_CLASSES} classes, weights have {n}")
    if b.shape != (n,):
        raise InvalidHead(f"biases have shape {list(b.shape)}, expected [{n}] to match weights")
    # Checked after the float32 cast: float64 values beyond float32's range become inf here.
    for name, arr in (("weights", w), ("biases", b)):
        bad = ~np.isfinite(arr)
        if bad.any():
            idx = tuple(int(i) for i in np.argwhere(bad)[0])
            raise InvalidHead(
                f"{name} contain {int(bad.sum())} non-finite value(s) (NaN/Inf), "
                f"first at index {list(idx)}: {arr[idx]}"
            )
    labels_t = validate_labels(labels)
    if len(labels_t) != n:
        raise InvalidHead(f"{len(labels_t)} labels given for a head with {n} classes")
    return w, b, labels_t


def top_indices(p: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest entries of p [n] (k clipped to n), largest first; ties keep
    class index order."""
    k = min(int(k), p.shape[-1])
    top = np.argpartition(-p, k - 1)[:k]
    return top[np.lexsort((top, -p[top]))]


def _readonly(arr: np.ndarray) -> np.ndarray:
    arr.setflags(write=False)
    return arr


@dataclass(frozen=True, eq=False)
class Head:
    """One version of one bot's head. Immutable; safe to share between threads.

    Attributes:
        bot_id: the bot this head belongs to.
        version: its version number in the store.
        labels: class names, `labels[i]` is column i of `weights`.
        weights: float32 [1536, n], read-only.
        biases: float32 [n], read-only.
        nbytes: what keeping it resident costs (arrays and labels).
        label_json_bytes: the longest label's length as ASCII JSON text (quotes included):
            what bounds an answer's size before it is built.
    """

    bot_id: str
    version: int
    labels: tuple[str, ...]
    weights: np.ndarray  # [1536, n] float32
    biases: np.ndarray  # [n] float32
    nbytes: int = field(init=False)
    label_json_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        w = np.ascontiguousarray(self.weights, dtype=np.float32)
        b = np.ascontiguousarray(self.biases, dtype=np.float32)
        if w.ndim != 2 or w.shape[0] != FEATURE_DIM or b.shape != (w.shape[1],):
            raise InvalidHead(
                f"head {self.bot_id!r}: weights {list(w.shape)} and biases {list(b.shape)} "
                f"do not form a [{FEATURE_DIM}, n] head"
            )
        if len(self.labels) != w.shape[1]:
            raise InvalidHead(
                f"head {self.bot_id!r}: {len(self.labels)} labels for {w.shape[1]} classes"
            )
        object.__setattr__(self, "labels", tuple(self.labels))
        object.__setattr__(self, "weights", _readonly(w))
        object.__setattr__(self, "biases", _readonly(b))
        # What keeping this head resident costs: the arrays plus the label strings.
        label_bytes = sum(sys.getsizeof(label) for label in self.labels)
        object.__setattr__(self, "nbytes", int(w.nbytes + b.nbytes + label_bytes))
        # The longest label as JSON text with every non-ASCII character escaped, quotes
        # included: no JSON encoding of a label is longer (what bounds an answer's size).
        object.__setattr__(self, "label_json_bytes",
                           max(len(encode_basestring_ascii(label)) for label in self.labels))

    @property
    def n_classes(self) -> int:
        return int(self.weights.shape[1])

    def logits(self, features: np.ndarray) -> np.ndarray:
        """Logits for a batch of trunk features.

        Args:
            features: float32 [N, 1536] (`PreLogitsFlatten` of the trunk).
        Returns:
            float32 [N, n].
        """
        f = np.asarray(features, dtype=np.float32)
        if f.ndim != 2 or f.shape[1] != FEATURE_DIM:
            raise ValueError(f"features have shape {list(f.shape)}, expected [N, {FEATURE_DIM}]")
        return f @ self.weights + self.biases  # [N, n]

    def probabilities(self, features: np.ndarray) -> np.ndarray:
        """Softmax of `logits(features)`, float32 [N, n]; each row sums to 1."""
        z = self.logits(features)  # [N, n]
        z = z - z.max(axis=1, keepdims=True)  # stable: the largest exponent is exp(0)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        return z

    def top_k(self, features: np.ndarray, k: int) -> list[list[tuple[str, float]]]:
        """The k most probable labels per row, best first: `[[(label, probability), ...], ...]`.

        k is clipped to the number of classes.
        """
        if k < 1:
            raise ValueError("k must be >= 1")
        p = self.probabilities(features)  # [N, n]
        return [[(self.labels[j], float(row[j])) for j in top_indices(row, k)] for row in p]

    def __repr__(self) -> str:
        return f"Head(bot_id={self.bot_id!r}, version={self.version}, n_classes={self.n_classes})"

"""OpenCOOD-schema hypes YAML: load, override (--set a.b=c), validate, save (yaml_parsers.py runs its yaml_parser).

The loader reads floats written as `1e-3` (PyYAML's YAML 1.1 resolver would leave them strings), as upstream's
loader does, and the numpy arrays upstream's own config.yaml holds (numpy_yaml.py), as plain lists. Validation
reports every missing or ill-typed key of a run in one line naming the file.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
from contextlib import contextmanager
from numbers import Real
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import yaml

from opencood_ddp.atomic import atomic_write
from opencood_ddp.errors import ConfigError
from opencood_ddp.numpy_yaml import add_numpy_constructors, plain

_FLOAT_RE = re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class HypesLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader that also resolves 1e-3 style floats, and reads the numpy number objects and tuples that
    ``yaml.dump`` writes: upstream's run folders hold a config.yaml dumped after its yaml_parser put a numpy array
    in the hypes (``grid_size``). parse_yaml_text turns them into plain lists and numbers."""


class HypesDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings HypesLoader would read as floats ('1e3'), so config.yaml round-trips."""


for _cls in (HypesLoader, HypesDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
add_numpy_constructors(HypesLoader)
HYPES_READS = ("only plain YAML, !!python/tuple and numpy's number arrays, scalars and dtypes (as yaml.dump writes "
               "them) are read")


def parse_yaml_text(text: str, source: str, fix: str = "fix the file") -> Any:
    try:
        return plain(yaml.load(text, Loader=HypesLoader))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        if isinstance(exc, yaml.constructor.ConstructorError):  # well-formed, but a tag no safe loader builds
            raise ConfigError(f"{source}: unsupported YAML tag{where} ({problem}); {HYPES_READS}; {fix}") from None
        raise ConfigError(f"{source}: malformed YAML{where} ({problem}); {fix}") from None


def load_hypes(path: str | os.PathLike) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"hypes file {path} is a folder; pass --hypes_yaml a YAML file in it (e.g. "
                          f"{path}/point_pillar_intermediate_fusion.yaml)")
    if not path.is_file():
        raise ConfigError(f"hypes file {path} does not exist; pass --hypes_yaml with an existing file "
                          f"(e.g. hypes_yaml/toy/...)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start}: {exc.object[exc.start:exc.start + 1]!r}); "
                          f"pass a hypes YAML file, or save it as UTF-8") from None
    hypes = parse_yaml_text(text, str(path))
    if not isinstance(hypes, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of keys (name, train_params, ...), "
                          f"got {type(hypes).__name__}; fix the file")
    return hypes


# How a bad hypes value is fixed: evaluation tools read a run's config.yaml and take no --set.
HYPES_FIX = "fix the hypes (in training also --set key=value)"


def split_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (['a', 'b', 'c'], the value read as YAML)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r} is not of the form key.sub=value")
    return key.strip().split("."), parse_yaml_text(value, f"--set {text!r}",
                                                   "fix the value (it is read as YAML: key=[1, 2], key='text')")


def _child(node: Any, part: str, path: str, create: bool) -> Any:
    if isinstance(node, dict):
        if part not in node:
            if not create:
                raise ConfigError(f"--set {path}: key {part!r} does not exist; check the spelling")
            node[part] = {}
        return node[part]
    if isinstance(node, list) and part.isdigit() and int(part) < len(node):
        return node[int(part)]
    raise ConfigError(f"--set {path}: cannot descend into {part!r} (parent is a {type(node).__name__}); "
                      f"check the key path")


def _open_placeholder(node: Any, part: str, below: str) -> None:
    """Upstream's files write ``args: []`` for a section without keys: a key set below it (not an index) makes it
    the mapping it stands for, as ``--set fusion.args.proj_first=false`` on upstream's own files needs."""
    if isinstance(node, dict) and isinstance(node.get(part), list) and not node[part] and not below.isdigit():
        node[part] = {}


def apply_overrides(hypes: dict, overrides: Iterable[str]) -> dict:
    """Return a copy of hypes with each `a.b.c=value` applied (value parsed as YAML: 2 -> int, [1,2] -> list).

    Intermediate mappings are created when missing (an empty list too: `_open_placeholder`); list elements are
    addressed by index (a.0.b=...).
    """
    hypes = copy.deepcopy(hypes)
    for text in overrides:
        parts, value = split_override(text)
        node = hypes
        for depth, part in enumerate(parts[:-1]):
            _open_placeholder(node, part, parts[depth + 1])
            node = _child(node, part, text, create=True)
        last = parts[-1]
        if isinstance(node, list) and last.isdigit() and int(last) < len(node):
            node[int(last)] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            raise ConfigError(f"--set {text}: cannot set {last!r} inside a {type(node).__name__}; check the key path")
    return hypes


def get_key(hypes: Mapping, dotted: str, default: Any = None) -> Any:
    node: Any = hypes
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


# ---------------------------------------------------------------------------------------------- validation
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool)


# numpy's RandomState, and np.random.seed that seed_everything calls, take seeds in [0, 2**32)
RANDOM_STATE_SEEDS = 2 ** 32
# The most times a model repeats a block (a level's convolutions, a transformer's depth, an iteration count): the
# baselines repeat theirs 1 to 8 times. A constructor builds the repeats one by one in Python, so 10**9 of them
# never end and never run out of memory to say so; upstream accepts any count.
MAX_REPEATS = 1000

KIND_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "int": (_is_int, "an integer"),
    "positive_int": (lambda v: _is_int(v) and v > 0, "a positive integer"),
    "count": (lambda v: _is_int(v) and 0 < v <= MAX_REPEATS, f"a positive integer of at most {MAX_REPEATS} (a "
              f"block's repeats)"),
    "number": (_is_number, "a number"),
    "positive_number": (lambda v: _is_number(v) and 0 < v < math.inf, "a positive number"),
    "seed": (lambda v: _is_int(v) and 0 <= v < RANDOM_STATE_SEEDS, "an integer in [0, 2**32)"),
    "str": (lambda v: isinstance(v, str) and bool(v), "a non-empty string"),
    "list": (lambda v: isinstance(v, list), "a list"),
    "dict": (lambda v: isinstance(v, dict), "a mapping"),
    # an args block: upstream's files write `args: []` (or leave it empty) where nothing is read
    "args": (lambda v: isinstance(v, dict) or v is None or (isinstance(v, list) and not v),
             "a mapping, or [] where none is read"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "any": (lambda v: True, "any value"),  # declared for the schema; the entry's check judges the value
}

_MISSING = object()

# Keys a run writes into its config.yaml that describe the run, not the baseline: dropped whenever hypes are loaded
# (a resume recomputes them). The one list; schema.OWN_KEYS adds the other keys only this project reads.
RUN_KEYS: Sequence[str] = ("batch_plan",)

# Keys the training engine itself reads; tasks add their own.
ENGINE_KEYS: Sequence[tuple[str, str]] = (
    ("name", "str"),
    ("train_params.batch_size", "positive_int"),
    ("train_params.epoches", "positive_int"),
    ("optimizer.core_method", "str"),
    ("optimizer.lr", "number"),
)
ENGINE_OPTIONAL_KEYS: Sequence[tuple[str, str]] = (
    ("train_params.eval_freq", "positive_int"),
    ("train_params.save_freq", "positive_int"),
    ("train_params.find_unused_parameters", "bool"),
    ("train_params.seed", "seed"),
    ("optimizer.args", "dict"),
    ("lr_scheduler.core_method", "str"),
)


def hypes_source(hypes: Mapping) -> str:
    """How error messages name hypes whose file is not known at that point: by the run's name."""
    return f"hypes {hypes.get('name', '')}".strip()


def hypes_origin(path: str | os.PathLike, overrides: Sequence[str]) -> str:
    """Where hypes came from, as a refusal of them names it: the file, and `with --set` where the command changed
    them (the fault may be in either)."""
    return f"{path} with --set" if overrides else str(path)


@contextmanager
def naming_file(hypes: Mapping, path: str | os.PathLike) -> Iterator[None]:
    """A refusal of ``hypes`` raised inside names ``path``, the file the hypes came from, before the run's name:
    the checks that build models, losses and datasets are handed the hypes, not their file (`hypes_source`)."""
    source = hypes_source(hypes)
    try:
        yield
    except ConfigError as error:
        text = str(error)
        if not text.startswith(f"{source}: "):
            raise
        raise ConfigError(f"{path} ({source}){text[len(source):]}") from None


def validate(hypes: Mapping, required: Iterable[tuple[str, str]], source: str,
             optional: Iterable[tuple[str, str]] = ()) -> None:
    """Raise one ConfigError listing every missing required key and every ill-typed key."""
    problems = []
    for key, kind in required:
        check, wanted = KIND_CHECKS[kind]
        value = get_key(hypes, key, _MISSING)
        if value is _MISSING:
            problems.append(_why_missing(hypes, key, wanted))
        elif not check(value):
            problems.append(f"key {key} must be {wanted}, got {value!r}")
    for key, kind in optional:
        check, wanted = KIND_CHECKS[kind]
        value = get_key(hypes, key, _MISSING)
        if value is not _MISSING and not check(value):
            problems.append(f"key {key} must be {wanted}, got {value!r}")
    if problems:  # once each: every key under a section that is not a mapping says the same
        raise ConfigError(f"{source}: " + "; ".join(dict.fromkeys(problems))
                          + f"; {HYPES_FIX}")



def _why_missing(hypes: Mapping, key: str, wanted: str) -> str:
    """'missing key K', or, where a section on K's path is there but not a mapping (`--set model.args=[1, 2]`),
    that section's fault: K is not missing from it, it cannot hold K."""
    parts = key.split(".")
    node: Any = hypes
    for depth, part in enumerate(parts[:-1]):
        node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is _MISSING:
            break
        if not isinstance(node, Mapping):
            section = ".".join(parts[:depth + 1])
            return f"key {section} must be a mapping, got {node!r}"
    return f"missing key {key} ({wanted})"


def range6(hypes: Mapping, key: str, source: str) -> tuple[float, ...]:
    """The value at ``key`` as a range ``(x_min, y_min, z_min, x_max, y_max, z_max)`` of floats, or a ConfigError."""
    value = get_key(hypes, key)
    if (not isinstance(value, (list, tuple)) or len(value) != 6
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)
            or not all(value[axis] < value[axis + 3] for axis in range(3))):
        raise ConfigError(f"{source}: key {key} must be [x_min, y_min, z_min, x_max, y_max, z_max] of finite numbers "
                          f"with min < max on each axis, got {value!r}; {HYPES_FIX}")
    return tuple(float(v) for v in value)


def save_hypes(hypes: Mapping, path: str | os.PathLike) -> None:
    """Write the resolved hypes as plain YAML (atomically: a half-written config.yaml breaks resume)."""
    text = yaml.dump(_plain(hypes), Dumper=HypesDumper, sort_keys=False, default_flow_style=None)
    atomic_write(path, lambda handle: handle.write(text.encode()))


def _plain(value: Any) -> Any:
    """numpy scalars/arrays and tuples to YAML-safe Python types, every key a string."""
    return plain(value, key=str)


# Sections a resumed run may change on purpose: more epochs, another lr or schedule, data moved elsewhere, the
# run's own records. Every other top-level section (the model, the data pipeline, the loss, a task's own) is
# what the checkpoint's weights were trained as.
RESUMABLE_SECTIONS = ("name", "root_dir", "validate_dir", "test_dir", "train_params", "optimizer", "lr_scheduler",
                      "batch_plan", "imports")


def section_digests(hypes: Mapping) -> dict:
    """{top-level section: short SHA-256 of its canonical JSON} for every section outside RESUMABLE_SECTIONS."""
    return {key: hashlib.sha256(json.dumps(_plain(value), sort_keys=True, default=str).encode()).hexdigest()[:16]
            for key, value in hypes.items() if key not in RESUMABLE_SECTIONS}


def changed_sections(saved: Mapping, current: Mapping) -> list:
    """The sections whose digest differs, or that only one side has."""
    return sorted(key for key in set(saved) | set(current) if saved.get(key) != current.get(key))


"""Registries of the perception side: a name in the hypes -> the class or function that builds it.

Each registry is looked up by one hypes key (``model.core_method``, ``fusion.core_method``, ...). An entry is
added with a decorator where it is defined, and declares the hypes keys it reads with their kinds, so that
validation lives with the entry:

    @MODELS.register("point_pillar_intermediate", required=(("model.args.voxel_size", "list"), ...))
    class PointPillarIntermediate(nn.Module): ...

The built-in entries are found by importing every module of the registry's packages on the first lookup, so
a new built-in model is one new file under ``opencood_ddp/models/``: no central table to edit. Entries from
outside the package come in through the hypes' top-level ``imports: [my_pkg.my_models]`` (``import_modules``),
which every rank runs before anything is built, as mmengine's ``custom_imports``.
"""
from __future__ import annotations

import difflib
import importlib
import os
import pkgutil
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import KIND_CHECKS, get_key, validate

KeySpec = Tuple[Tuple[str, str], ...]  # ((dotted hypes key, kind of hypes.KIND_CHECKS), ...)
IMPORTS_KEY = "imports"


@dataclass(frozen=True)
class Entry:
    """One registered name: the object, the hypes keys it reads, and free-form facts (``meta``)."""

    name: str
    obj: Any
    required: KeySpec = ()
    optional: KeySpec = ()
    check: Optional[Callable[[Mapping, str], None]] = None  # cross-key rules the kinds cannot say
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def keys(self) -> KeySpec:
        """Every key this entry reads: its part of the hypes schema."""
        return tuple(self.required) + tuple(self.optional)

    def validate(self, hypes: Mapping, source: str) -> None:
        """One ConfigError naming every missing or ill-typed key, then the entry's own cross-key check."""
        validate(hypes, self.required, source, self.optional)
        if self.check is not None:
            self.check(hypes, source)


class Registry:
    """Names looked up by ``key`` (a dotted hypes key); ``packages`` hold the built-in entries."""

    def __init__(self, kind: str, key: str, packages: Sequence[str] = (), default: Optional[str] = None):
        self.kind, self.key, self.packages = kind, key, tuple(packages)
        self.default = default  # the name an absent key means (fusion.dataset: opv2v, upstream's only layout)
        self._entries: Dict[str, Entry] = {}
        self._builtins_loaded = False

    def register(self, name: str, *, required: Optional[Iterable[Tuple[str, str]]] = None,
                 optional: Optional[Iterable[Tuple[str, str]]] = None,
                 check: Optional[Callable[[Mapping, str], None]] = None,
                 add_required: Iterable[Tuple[str, str]] = (), add_optional: Iterable[Tuple[str, str]] = (),
                 **meta: Any) -> Callable[[Any], Any]:
        """Decorator: ``@REG.register("name", required=..., optional=..., check=..., **meta)``.

        Left out, ``required`` and ``optional`` are the class's own ``required_keys`` and ``optional_keys``
        (the datasets declare theirs as class attributes, which subclasses extend), or else, for a subclass of a
        class registered here, the nearest such base's: its keys, its check (run before this entry's own
        ``check``) and its meta (which this entry's ``meta`` may override). ``add_required`` and
        ``add_optional`` extend whichever keys the entry ends up with, so a subclass of a built-in model that
        reads one more key declares that key alone.
        """

        def add(obj: Any) -> Any:
            base = self._registered_base(obj) if required is None and optional is None else None
            needed = self._declared(obj, required, "required_keys", base.required if base else ())
            accepted = self._declared(obj, optional, "optional_keys", base.optional if base else ())
            needed, accepted = _extended(needed, add_required), _extended(accepted, add_optional)
            for key, kind in needed + accepted:
                if kind not in KIND_CHECKS:
                    raise ValueError(f"{self.kind} {name!r}: key {key} has unknown kind {kind!r}; "
                                     f"use one of {sorted(KIND_CHECKS)}")
            known = self._entries.get(name)
            # Re-importing the same definition (a module imported twice under two names) is harmless; two
            # different objects under one name would make the hypes ambiguous.
            if known is not None and _qualified(known.obj) != _qualified(obj):
                raise ValueError(f"{self.kind} {name!r} is registered twice: {_qualified(known.obj)} and "
                                 f"{_qualified(obj)}; rename one")
            inherited_meta = dict(base.meta) if base else {}
            self._entries[name] = Entry(name, obj, needed, accepted, _chained(base.check if base else None, check),
                                        {**inherited_meta, **meta})
            return obj

        return add

    def _registered_base(self, obj: Any) -> Optional[Entry]:
        """The entry of the nearest base class of `obj` registered here (None for a function or a new root)."""
        for base in getattr(obj, "__mro__", ())[1:]:
            for entry in self._entries.values():
                if entry.obj is base:
                    return entry
        return None

    @staticmethod
    def _declared(obj: Any, given: Optional[Iterable[Tuple[str, str]]], attribute: str,
                  inherited: KeySpec) -> KeySpec:
        if given is not None:
            return tuple(given)
        if hasattr(obj, attribute):
            return tuple(getattr(obj, attribute))
        return tuple(inherited)

    def names(self) -> List[str]:
        self._load_builtins()
        return sorted(self._entries)

    def entries(self) -> List[Entry]:
        self._load_builtins()
        return [self._entries[name] for name in sorted(self._entries)]

    def __contains__(self, name: object) -> bool:
        self._load_builtins()
        return name in self._entries

    def get(self, name: Any, source: str = "hypes") -> Entry:
        """The entry called ``name``, or one ConfigError that lists the registered names."""
        self._load_builtins()
        if isinstance(name, str) and name in self._entries:
            return self._entries[name]
        raise ConfigError(f"{source}: {self.key} {name!r} is not one of {', '.join(self.names())}"
                          f"{did_you_mean(name, self.names())}; fix the hypes, or list the module that registers "
                          f"it under '{IMPORTS_KEY}:'")

    def name_in(self, hypes: Mapping) -> Any:
        """The name the hypes give at ``self.key``, or the registry's default when the key is absent."""
        return get_key(hypes, self.key, self.default)

    def lookup(self, hypes: Mapping, source: str) -> Entry:
        """The entry named at ``self.key`` in the hypes (or the default), its keys validated."""
        if self.default is None or get_key(hypes, self.key) is not None:
            validate(hypes, ((self.key, "str"),), source)
        entry = self.get(self.name_in(hypes), source)
        entry.validate(hypes, source)
        return entry

    def _load_builtins(self) -> None:
        if self._builtins_loaded:
            return
        self._builtins_loaded = True  # set first: the modules imported below call register() on this registry
        for package in self.packages:
            import_package(package)


def _extended(keys: KeySpec, more: Iterable[Tuple[str, str]]) -> KeySpec:
    """`keys` and then `more`; a key in both takes the kind given in `more`."""
    more = tuple(more)
    added = {key for key, _ in more}
    return tuple(spec for spec in keys if spec[0] not in added) + more


def _chained(first: Optional[Callable[[Mapping, str], None]],
             then: Optional[Callable[[Mapping, str], None]]) -> Optional[Callable[[Mapping, str], None]]:
    """One check that runs `first` (a base entry's) and then `then` (the subclass's own)."""
    if first is None or then is None or first is then:
        return then or first

    def both(hypes: Mapping, source: str) -> None:
        first(hypes, source)
        then(hypes, source)

    return both


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def did_you_mean(name: Any, choices: Sequence[str]) -> str:
    """' (did you mean X?)' for the closest choice, or ''."""
    close = difflib.get_close_matches(str(name), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def import_package(name: str) -> None:
    """Import a module, and every module directly inside it when it is a package (their register() calls)."""
    module = importlib.import_module(name)
    for info in pkgutil.iter_modules(getattr(module, "__path__", [])):
        if not info.name.startswith("_"):
            importlib.import_module(f"{name}.{info.name}")


def import_modules(hypes: Mapping, source: str = "hypes") -> List[str]:
    """Import the modules listed under the hypes' top-level ``imports:`` (out-of-tree registry entries).

    Called on every rank before anything is built. DataLoader workers forked afterwards inherit the modules;
    spawned workers re-import them when they unpickle the dataset. The current folder is searched too (after
    everything else): torchrun runs ``tools/train_ddp.py`` with the script's folder, not the working folder, at
    the head of ``sys.path``, and a user's ``my_models.py`` next to their hypes must still be found.
    """
    names = hypes.get(IMPORTS_KEY) or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{source}: key {IMPORTS_KEY} must be a list of module names (imports: [my_pkg.my_models]), "
                          f"got {names!r}; fix the hypes")
    if names and os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of a user's module is reported as one line
            raise ConfigError(f"{source}: module {name!r} listed under {IMPORTS_KEY} cannot be imported "
                              f"({type(exc).__name__}: {exc}); install it, put it on PYTHONPATH, or fix the "
                              f"name") from None
    return list(names)


# The perception side's registries and the hypes key each is looked up by.
MODELS = Registry("model", "model.core_method", ("opencood_ddp.models",))
DATASETS = Registry("fusion dataset", "fusion.core_method", ("opencood_ddp.data.datasets",))
# The data set a split is read from (HEAL's and CoAlign's key): its layout, poses, labels and conventions.
SOURCES = Registry("data set", "fusion.dataset", ("opencood_ddp.data.sources",), default="opv2v")
PREPROCESSORS = Registry("pre-processor", "preprocess.core_method", ("opencood_ddp.data.preprocessors",))
POSTPROCESSORS = Registry("post-processor", "postprocess.core_method", ("opencood_ddp.postprocess",))
LOSSES = Registry("loss", "loss.core_method", ("opencood_ddp.loss",))
YAML_PARSERS = Registry("yaml parser", "yaml_parser", ("opencood_ddp.yaml_parsers",))
SCHEDULERS = Registry("lr scheduler", "lr_scheduler.core_method", ("opencood_ddp.engine.schedulers",))

ALL_REGISTRIES: Tuple[Registry, ...] = (MODELS, DATASETS, SOURCES, PREPROCESSORS, POSTPROCESSORS, LOSSES,
                                        YAML_PARSERS, SCHEDULERS)

__all__ = ["Entry", "Registry", "MODELS", "DATASETS", "SOURCES", "PREPROCESSORS", "POSTPROCESSORS", "LOSSES",
           "YAML_PARSERS", "SCHEDULERS", "ALL_REGISTRIES", "import_modules", "import_package", "did_you_mean",
           "IMPORTS_KEY"]

"""Every hypes key must be one somebody reads: a mistyped key is refused, not trained past.

The keys a hypes file may hold are the union of
- the engine's (hypes.ENGINE_KEYS and ENGINE_OPTIONAL_KEYS) and the task's (its `extra` keys);
- each registry entry the hypes selects (model, fusion dataset, pre- and post-processor, loss, yaml parser, lr
  scheduler): its registry key and the keys it declares, so that an out-of-tree model registered through
  `imports:` declares its own;
- the keys upstream's hypes files carry that nothing here reads (UPSTREAM_CARRIED), so that upstream's files still
  load unchanged.
A key declared with kind "dict" and no declared key below it accepts any key below it (optimizer.args: torch's own
keyword arguments, which torch checks). A key that is none of these is refused with one line that names it and the closest accepted key.
"""
from __future__ import annotations

import difflib
from typing import Iterable, Iterator, Mapping, Sequence

from opencood_ddp.errors import ConfigError
from opencood_ddp.hypes import ENGINE_KEYS, ENGINE_OPTIONAL_KEYS, RUN_KEYS
from opencood_ddp.registry import ALL_REGISTRIES, IMPORTS_KEY

# Keys (or whole sections) of upstream's hypes files that nothing here reads, and why they are harmless.
UPSTREAM_CARRIED: Mapping[str, str] = {
    "model.args.max_cav": "upstream's models keep a copy of train_params.max_cav; the datasets read that one",
    "model.args.batch_size": "SECOND's fixed batch; the batch comes from the data here",
}
# Keys only this project reads: what a run records about itself (hypes.RUN_KEYS), the hypes-level imports list and
# the task's name. The schema accepts them; tools/export_upstream.py drops them for upstream's loader.
OWN_KEYS: Sequence[str] = tuple(RUN_KEYS) + (IMPORTS_KEY, "task")


def _leaves(node: Mapping, prefix: str = "") -> Iterator[tuple[str, object]]:
    """(dotted path, value) of the hypes' leaves; an empty mapping is a leaf of its own."""
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def selected_entries(hypes: Mapping) -> list:
    """The registry entries the hypes select, or None when one of the names is not registered (that lookup gives
    its own error, and an unknown model's keys would all look unknown)."""
    entries = []
    for registry in ALL_REGISTRIES:
        name = registry.name_in(hypes)
        if name is None:
            continue
        if not isinstance(name, str) or name not in registry:
            return None
        entries.append(registry.get(name))
    return entries


def check_selected_entries(hypes: Mapping, source: str) -> None:
    """Each selected entry's keys and cross-key rules (the checks building it runs), before anything is built:
    one ConfigError for the first that fails."""
    for entry in selected_entries(hypes) or ():
        entry.validate(hypes, source)


def accepted_keys(hypes: Mapping, extra: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
    """Every accepted key with its kind."""
    keys = dict(tuple(ENGINE_KEYS) + tuple(ENGINE_OPTIONAL_KEYS) + tuple(extra))
    keys.update({key: "any" for key in OWN_KEYS})
    keys.update({key: "dict" for key in UPSTREAM_CARRIED})
    for entry in selected_entries(hypes) or ():
        keys.update(dict(entry.keys))
    keys.update({registry.key: "str" for registry in ALL_REGISTRIES})
    return keys


def _opaque(key: str, accepted: Mapping[str, str]) -> bool:
    """A "dict" key with no accepted key below it takes any keys (optimizer.args: torch's keyword arguments)."""
    return accepted[key] == "dict" and not any(other.startswith(key + ".") for other in accepted)


def _covered(leaf: str, value: object, accepted: Mapping[str, str]) -> bool:
    """An accepted key; or below an opaque section; or an empty section with accepted keys below it."""
    if leaf in accepted:
        return True
    parts = leaf.split(".")
    if any(_opaque(".".join(parts[:n]), accepted) for n in range(1, len(parts)) if ".".join(parts[:n]) in accepted):
        return True
    return value in ({}, []) and any(key.startswith(leaf + ".") for key in accepted)


def unknown_keys(hypes: Mapping, extra: Iterable[tuple[str, str]] = ()) -> list[str]:
    if selected_entries(hypes) is None:
        return []
    accepted = accepted_keys(hypes, extra)
    return [leaf for leaf, value in _leaves(hypes) if not _covered(leaf, value, accepted)]


def named_unknown_keys(hypes: Mapping, extra: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Every key that neither this project nor upstream's hypes use, each with its nearest known key."""
    extra = tuple(extra)
    unknown = unknown_keys(hypes, extra)
    accepted = sorted(accepted_keys(hypes, extra)) if unknown else []
    named = []
    for key in unknown:
        close = difflib.get_close_matches(key, accepted, n=1, cutoff=0.75)
        named.append(f"{key} (did you mean {close[0]}?)" if close else key)
    return named


def check_known_keys(hypes: Mapping, source: str, extra: Iterable[tuple[str, str]] = ()) -> None:
    """One ConfigError naming every key that neither this project nor upstream's hypes use."""
    named = named_unknown_keys(hypes, extra)
    if not named:
        return
    many = len(named) > 1
    raise ConfigError(f"{source}: unknown key{'s' if many else ''} {', '.join(named)}: neither this project nor "
                      f"upstream's hypes files use {'them' if many else 'it'}; fix the spelling or remove "
                      f"{'them' if many else 'it'} (a model of your own declares its keys where it is registered)")

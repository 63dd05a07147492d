"""A faster route to exactly what a PyYAML safe loader builds, for the frame files read once per CAV and sample.

PyYAML's C loader parses in C, but it calls the Python resolver for every scalar (up to eight regular
expressions each) and then builds the document through the general Python constructor, which handles
anchors, merge keys and recursive structures node by node. An OPV2V frame yaml is a few hundred plain numbers
in plain mappings and lists, so about half of its parse goes to that generality.

``load(data, loader_cls)`` builds the same value as ``yaml.load(data, Loader=loader_cls)`` with two changes
in how, never in what:

- plain scalars are resolved when they are built, and the two shapes a frame file is made of, a decimal
  number with a dot and a decimal integer, are recognised by one expression each. Their tag is the one the
  loader's resolver would pick (no YAML 1.1 bool, null, int, timestamp or merge pattern accepts them before
  its float or int pattern does), and ``float``/``int`` of the text equal PyYAML's constructors on them.
  Every other plain scalar goes through the loader's own resolver.
- plain mappings and lists are built by one recursive function. A node with an explicit tag (``!!binary``,
  ``!!python/tuple``, V2V4Real's numpy arrays) is built by the loader's own constructor, after the plain
  scalars under it are given their real tags.

Whatever this route does not cover exactly (merge keys ``<<``, the ``=`` value key, an alias of a node that
is still being built, an unhashable key, any error) is handed back: the caller parses the file again with
the loader itself, which gives the value or the error that loader gives. An alias of a finished node is the
same object, as in PyYAML.
"""
from __future__ import annotations

import gc
import re
from typing import Any, Dict

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

# The placeholder is compared by identity (``is``): a document that writes this text as a tag makes another
# string object, and a tag cannot hold a space anyway.
_DEFERRED_TAG = "!opencood_ddp deferred plain scalar"
_MAP_TAG = yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG
_SEQ_TAG = yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG
_STR_TAG = yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG
_FLOAT_TAG = "tag:yaml.org,2002:float"
_INT_TAG = "tag:yaml.org,2002:int"
_MERGE_TAGS = ("tag:yaml.org,2002:merge", "tag:yaml.org,2002:value")  # keys the constructor rewrites

# A subset of YAML 1.1's float (``[-+]?[0-9][0-9_]*\.[0-9_]*([eE][-+][0-9]+)?``) and of the added rule for an
# exponent without a sign; float() reads it as PyYAML's construct_yaml_float does (no '_', no ':', no inf).
_PLAIN_FLOAT = re.compile(r"[-+]?[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?").fullmatch
# A subset of YAML 1.1's decimal int (``[-+]?(0|[1-9][0-9_]*)``): no leading 0 (octal), no '_', no ':'.
_PLAIN_INT = re.compile(r"[-+]?(?:0|[1-9][0-9]*)").fullmatch


class HandBack(Exception):
    """This document needs the loader's own constructor; parse it again with the loader."""


def _defer_plain_scalars(self: yaml.BaseLoader, kind: type, value: Any, implicit: Any) -> str:
    """The composer's resolver: a plain scalar keeps a placeholder tag until it is built (see module doc); a
    mapping or list without a tag gets the default tag the loader's resolver gives it (it has no path rules)."""
    if kind is ScalarNode:
        return _DEFERRED_TAG if implicit[0] else _STR_TAG
    return _MAP_TAG if kind is MappingNode else _SEQ_TAG


_FAST_LOADERS: Dict[type, type] = {}


def _fast_loader(loader_cls: type) -> type:
    """``loader_cls`` with the deferring resolver, plus a cache of the tags its resolver gives plain words."""
    fast = _FAST_LOADERS.get(loader_cls)
    if fast is None:
        if loader_cls.yaml_path_resolvers:  # path rules tag nodes by position: this route does not apply them
            raise TypeError(f"{loader_cls.__name__} has path resolvers; fast_yaml builds without them")
        fast = type(f"Deferred{loader_cls.__name__}", (loader_cls,),
                    {"resolve": _defer_plain_scalars, "_resolve_now": loader_cls.resolve, "_word_tags": {}})
        _FAST_LOADERS[loader_cls] = fast
    return fast


_WORD_CACHE_LIMIT = 4096  # distinct non-numeric plain scalars remembered per loader (keys, class names)


class _Builder:
    """Builds one document's node graph; ``loader`` is the deferring loader that composed it."""

    def __init__(self, loader: yaml.BaseLoader):
        self.loader = loader
        self.word_tags: Dict[str, str] = loader._word_tags
        self.built: Dict[int, Any] = {}  # id(collection node) -> its value, for aliases
        self.building: set = set()

    def resolve_word(self, value: str) -> str:
        """The tag the loader's resolver gives the plain scalar ``value``, remembered for words (keys, names)."""
        tag = self.word_tags.get(value)
        if tag is None:
            tag = self.loader._resolve_now(ScalarNode, value, (True, False))
            if len(self.word_tags) < _WORD_CACHE_LIMIT and not (_PLAIN_FLOAT(value) or _PLAIN_INT(value)):
                self.word_tags[value] = tag
        return tag

    def build(self, node: yaml.Node) -> Any:
        if node.__class__ is ScalarNode:
            return self.scalar(node)
        key = id(node)
        if key in self.built:
            return self.built[key]
        if key in self.building or node.tag not in (_MAP_TAG, _SEQ_TAG):
            return self.tagged(node, key)
        self.building.add(key)
        build = self.build
        # A plain decimal number is the commonest node by far: built here, without a call
        if node.tag == _SEQ_TAG:
            value: Any = [float(item.value) if item.tag is _DEFERRED_TAG and _PLAIN_FLOAT(item.value) else build(item)
                          for item in node.value]
        else:
            value = {}
            try:
                for key_node, value_node in node.value:
                    value[build(key_node)] = (float(value_node.value) if value_node.tag is _DEFERRED_TAG
                                              and _PLAIN_FLOAT(value_node.value) else build(value_node))
            except TypeError:  # an unhashable key: the loader's own error
                raise HandBack from None
        self.building.discard(key)
        self.built[key] = value
        return value

    def scalar(self, node: ScalarNode) -> Any:
        value = node.value
        tag = node.tag
        if tag is _DEFERRED_TAG:
            tag = self.word_tags.get(value)
            if tag is None:
                if _PLAIN_FLOAT(value):
                    return float(value)
                if _PLAIN_INT(value):
                    return int(value)
                tag = self.resolve_word(value)
            if tag in _MERGE_TAGS:
                raise HandBack
            node.tag = tag
        if tag == _STR_TAG:
            return value
        return self.loader.construct_object(node, deep=True)

    def tagged(self, node: yaml.Node, key: int) -> Any:
        """A node with an explicit tag, or an alias into a node still being built."""
        if key in self.building:
            raise HandBack  # a recursive structure: PyYAML builds it in two passes
        self.give_real_tags(node, set())
        value = self.loader.construct_object(node, deep=True)
        self.built[key] = value
        return value

    def give_real_tags(self, node: yaml.Node, seen: set) -> None:
        if id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            if node.tag is _DEFERRED_TAG:
                value = node.value
                node.tag = _FLOAT_TAG if _PLAIN_FLOAT(value) else _INT_TAG if _PLAIN_INT(value) else \
                    self.resolve_word(value)
            return
        items = node.value if isinstance(node, SequenceNode) else [item for pair in node.value for item in pair]
        for item in items:
            self.give_real_tags(item, seen)


def load(data: bytes, loader_cls: type) -> Any:
    """The value of the single document in ``data`` as ``loader_cls`` (a safe PyYAML loader) builds it.
    Raises HandBack (or a YAMLError) where the caller must parse with ``loader_cls`` itself."""
    loader = _fast_loader(loader_cls)(data)
    collecting = gc.isenabled()
    gc.disable()  # see _pause_note
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        return _Builder(loader).build(node)
    finally:
        loader.dispose()
        if collecting:
            gc.enable()


# _pause_note: the node graph (a few hundred nodes, twice as many marks) lives only while the document is
# built and holds no reference cycles, so reference counting frees it. Left on, the cyclic collector runs
# every 700 allocations during the build, promotes the live nodes to older generations and so triggers full
# collections, which scan every object of a dataset process: 8 % of an OPV2V sample's time (measured on the
# toy train split, 1 thread). Collection resumes when the document is built; garbage made meanwhile is
# collected then.


__all__ = ["HandBack", "load"]

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

Before that, a document written in block style, as PyYAML's ``dump`` writes frame files, takes a shorter
route still (``_load_blocks``): each top-level key's lines are read by one regular expression per line and
built by a loop over them, without events, nodes or marks. It covers only lines of three shapes, ``key:``,
``key: scalar`` and ``- scalar``, with a scalar that is a plain decimal number or a word the loader resolves
to a string, and indentation that nests them; a top-level key whose lines are anything else (a comment,
a flow list, a tag) is built by the node route below from its own text, unless one of the loader's own key
routes (``fast_yaml_key_routes``: V2V4Real's numpy pose as PyYAML dumps it) reads that text exactly. A document that
could make a key's text mean something else alone than in place (an anchor anywhere, a line that starts
at column 0 and is neither a key nor a list item, a first line that is not a key) goes whole to the node route,
and so does every document of a loader whose resolver does not read plain numbers as this route does (asked
once per loader class).

Whatever this route does not cover exactly (merge keys ``<<``, the ``=`` value key, an alias of a node that
is still being built, an unhashable key, any error) is handed back: the caller parses the file again with
the loader itself, which gives the value or the error that loader gives. An alias of a finished node is the
same object, as in PyYAML.
"""
from __future__ import annotations

import gc
import re
from typing import Any, Dict, List

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
_FLOAT = r"[-+]?[0-9]+\.[0-9]*(?:[eE][-+]?[0-9]+)?"
_PLAIN_FLOAT = re.compile(_FLOAT).fullmatch
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
    collecting = gc.isenabled()
    gc.disable()  # see _pause_note
    try:
        text = _block_text(data, loader_cls)
        if text is not None:
            return _load_blocks(text, loader_cls)
        return _load_nodes(data, loader_cls)
    finally:
        if collecting:
            gc.enable()


def _load_nodes(data: bytes, loader_cls: type) -> Any:
    """The node route: libyaml composes, the builder above builds."""
    loader = _fast_loader(loader_cls)(data)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        return _Builder(loader).build(node)
    finally:
        loader.dispose()


# ---- The block route ---------------------------------------------------------------------------------------
# A scalar token: what a plain number or a word can be made of. The regular expressions below accept a line
# only whole (``$``), so a token never stands for a longer plain scalar (``a b``, ``1.5 # note``).
_TOKEN = r"[A-Za-z0-9_.+-]+"
# One line: indentation, then a list item (its number or other token) or a key with an optional value (its
# number or other token). findall gives one tuple per line it accepts.
_BLOCK_LINE = re.compile(rf"^( *)(?:- (?:({_FLOAT})|({_TOKEN}))|({_TOKEN}):(?: (?:({_FLOAT})|({_TOKEN})))?)$",
                         re.MULTILINE)
# Where a top-level key starts: a line at column 0 that begins with a plain key and ``:`` (then a space or
# the line's end). Inside the previous key's text it could only be in an unclosed flow list or quote, and
# that text alone is then an error, so the whole document goes to the loader.
_TOP_KEY = re.compile(rf"^{_TOKEN}:(?: .*)?$", re.MULTILINE)
# Inside a top-level key's text, a line at column 0 that is neither a key nor a list item (``-`` then a space
# or the end of the line): a document marker, a comment, a blank line, a flow continuation.
_STRAY_COLUMN_0 = re.compile(r"\n(?![ ]|-[ \n]|-$)")
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*").fullmatch
_EXPECTED_NUMBERS = (("1.5", _FLOAT_TAG), ("-2.", _FLOAT_TAG), ("1.5e5", _FLOAT_TAG), ("1.5e-5", _FLOAT_TAG),
                     ("+7", _INT_TAG), ("0", _INT_TAG), ("-12", _INT_TAG))


class _NotBlock(Exception):
    """This top-level key's lines are not all of the block route's shapes: the node route builds it."""


class _BlockWords:
    """Per loader class: whether its resolver gives plain numbers the tags the route assumes, and which
    words it resolves to a string."""

    _by_loader: Dict[type, "_BlockWords"] = {}

    def __init__(self, loader_cls: type):
        self.resolver = loader_cls("")  # only its resolve() is used
        self.is_string: Dict[str, bool] = {}
        self.numbers_ok = not loader_cls.yaml_path_resolvers and all(
            self.resolve(text) == tag for text, tag in _EXPECTED_NUMBERS)

    @classmethod
    def of(cls, loader_cls: type) -> "_BlockWords":
        words = cls._by_loader.get(loader_cls)
        if words is None:
            words = cls._by_loader[loader_cls] = cls(loader_cls)
        return words

    def resolve(self, text: str) -> str:
        return self.resolver.resolve(ScalarNode, text, (True, False))

    def scalar(self, token: str) -> Any:
        """The value of a plain token, or _NotBlock for one that is not a number or a word read as a string."""
        string = self.is_string.get(token)  # words only: keys and names repeat, numbers seldom do
        if string:
            return token
        if string is None:
            if _PLAIN_FLOAT(token):
                return float(token)
            if _PLAIN_INT(token):
                return int(token)
            string = bool(_WORD(token)) and self.resolve(token) == _STR_TAG
            if len(self.is_string) < _WORD_CACHE_LIMIT:
                self.is_string[token] = string
            if string:
                return token
        raise _NotBlock


def _block_text(data: bytes, loader_cls: type) -> Any:
    """The document as text where the block route may take it, else None."""
    if b"&" in data or not _TOP_KEY.match(data[:256].decode("ascii", "replace")):
        return None  # an anchor could join two keys' texts; a first line that is not a key: the node route
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None  # the loader's own decoding (a BOM, UTF-8, UTF-16)
    return text if _BlockWords.of(loader_cls).numbers_ok else None


def _load_blocks(text: str, loader_cls: type) -> Any:
    """The document, one top-level key's text at a time: the block route where its lines allow it, else
    the node route on that text alone, which means there what it means in place (see _block_text)."""
    words = _BlockWords.of(loader_cls)
    value: Dict[Any, Any] = {}
    for part in _top_level_parts(text):
        try:
            value.update(_block_mapping(part, words))
        except _NotBlock:
            if _STRAY_COLUMN_0.search(part, 0, len(part) - 1):
                return _load_nodes(text.encode("ascii"), loader_cls)
            value.update(_other_key(part, loader_cls, words))
    return value


def _other_key(part: str, loader_cls: type, words: _BlockWords) -> Dict[Any, Any]:
    """A top-level key whose lines the block route does not read: by the first of the loader's own text
    routes (``fast_yaml_key_routes``) that takes its text, else by the node route on that text alone.

    A key route takes the text of one top-level key and gives (key token, value) only where that value is
    exactly what the loader builds from the text, else None; the key token is resolved here as a block key."""
    for route in getattr(loader_cls, "fast_yaml_key_routes", ()):
        taken = route(part)
        if taken is not None:
            key, item = taken
            try:
                return {words.scalar(key): item}
            except _NotBlock:
                break  # a key that is not a number or a string word: the node route resolves it
    built = _load_nodes(part.encode("ascii"), loader_cls)
    if not isinstance(built, dict):
        raise HandBack
    return built


def _top_level_parts(text: str) -> List[str]:
    """The text of each top-level key, from its line to the next top-level key's (the first line is one)."""
    starts = [match.start() for match in _TOP_KEY.finditer(text)]
    return [text[start:end] for start, end in zip(starts, starts[1:] + [len(text)])]


def _block_mapping(part: str, words: _BlockWords) -> Dict[Any, Any]:
    lines = _BLOCK_LINE.findall(part)
    if len(lines) != part.count("\n") + (not part.endswith("\n")):
        raise _NotBlock  # a line of another shape
    value, end = _block_value(lines, 0, 0, words)
    if end != len(lines):
        raise _NotBlock
    return value


def _block_value(lines: list, index: int, indent: int, words: _BlockWords) -> tuple:
    """(value, next line) of the block at ``lines[index]``, whose lines are indented by ``indent``."""
    if lines[index][3]:
        return _block_map(lines, index, indent, words)
    return _block_list(lines, index, indent, words)


def _block_map(lines: list, index: int, indent: int, words: _BlockWords) -> tuple:
    value: Dict[Any, Any] = {}
    count = len(lines)
    while index < count:
        spaces, _, _, key, number, token = lines[index]
        if len(spaces) < indent:
            break
        if len(spaces) > indent or not key:
            raise _NotBlock  # over-indented, or a list item among keys: the loader's error
        key = words.scalar(key)
        index += 1
        if number:
            value[key] = float(number)
        elif token:
            value[key] = words.scalar(token)
        else:  # ``key:``: a block below it, deeper or a list at the same indentation
            if index == count:
                raise _NotBlock  # an empty value (None)
            below = len(lines[index][0])
            if below > indent:
                value[key], index = _block_value(lines, index, below, words)
            elif below == indent and not lines[index][3]:
                value[key], index = _block_list(lines, index, indent, words)
            else:
                raise _NotBlock
    return value, index


def _block_list(lines: list, index: int, indent: int, words: _BlockWords) -> tuple:
    value = []
    append = value.append
    count = len(lines)
    while index < count:
        spaces, number, token, key, _, _ = lines[index]
        if key or len(spaces) != indent:
            break
        append(float(number) if number else words.scalar(token))
        index += 1
    return value, index


# _pause_note: the node graph (a few hundred nodes, twice as many marks), or the block route's line tuples,
# lives only while the document is built and holds no reference cycles, so reference counting frees it. Left
# on, the cyclic collector runs every 700 allocations during the build, promotes the live nodes to older
# generations and so triggers full collections, which scan every object of a dataset process: 8 % of an OPV2V
# sample's time (measured on the toy train split, 1 thread). Collection resumes when the document is built;
# garbage made meanwhile is collected then.


__all__ = ["HandBack", "load"]

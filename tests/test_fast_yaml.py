"""fast_yaml builds exactly what the frame loaders build, and hands back whatever it does not cover.

The reference is PyYAML's own ``yaml.load`` with the same loader class: the values must be equal and of the
same types (1 and 1.0 and True compare equal in Python, so types are compared too), and a document the loader
refuses must be refused with the loader's own error.
"""
from __future__ import annotations

import datetime
import math

import numpy as np
import pytest
import yaml

from opencood_ddp.data import fast_yaml
from opencood_ddp.data.opv2v import Opv2vYamlLoader, load_opv2v_yaml, load_yaml_bytes
from opencood_ddp.data.sources.v2v4real import V2V4RealYamlLoader, dumped_ndarray_key
from opencood_ddp.errors import DataError


def _typed(value, inside=()):
    """A comparable form that keeps every scalar's type (and NaN, -0.0 and array dtypes exact); a collection
    that contains itself (a recursive alias) shows as ("cycle", how many levels up)."""
    if isinstance(value, (dict, list, tuple)) and id(value) in inside:
        return ("cycle", len(inside) - inside.index(id(value)))
    inside = inside + (id(value),)
    if isinstance(value, dict):
        return ("dict", [(_typed(key, inside), _typed(item, inside)) for key, item in value.items()])
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, [_typed(item, inside) for item in value])
    if isinstance(value, np.ndarray):
        return ("ndarray", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, float):
        return ("float", "nan" if math.isnan(value) else value.hex())
    return (type(value).__name__, value)


def _same_as_loader(text: str, loader=Opv2vYamlLoader):
    """The loader's value, after checking that the frame readers' route (fast_yaml, handing back to the loader
    where it must) builds the same; where the loader refuses the document, the route raises the same error."""
    data = text.encode()
    try:
        expected = yaml.load(data, Loader=loader)
    except (yaml.YAMLError, ValueError, TypeError) as exc:
        with pytest.raises(type(exc)) as ours:
            load_yaml_bytes(data, loader)
        assert str(ours.value) == str(exc)
        return None
    assert _typed(load_yaml_bytes(data, loader)) == _typed(expected)
    return expected


SCALARS = """
decimals: [0.0, -0.0, +1.5, 1., 15.725032, -87.87199, 1.5e-05, 1.5E+3, 2.5e3, 0.1e-1]
no_dot_exponents: [1e-3, 2E5, -4e+2]
ints: [0, -0, +7, 1151, -12, 010, 0o17, 0x1F, 0b101, 1_000, 1:30, 00]
floats_1_1: [1_000.5, .5, .5e-3, 1:30.5, .inf, -.Inf, .NaN, 6.8523015e+5]
words: [Van, Car, yes, No, on, OFF, true, False, null, Null, ~, '', "1.5", '7', n, y, key=, abc123]
empty:
timestamps: [2021-09-06, 2001-12-14t21:59:43.10-05:00]
quoted: {"0": a, '1.5': b}
binary: !!binary aGVsbG8=
tagged: [!!str 1.5, !!int "12", !!float "3", !!bool "yes"]
nested: [[1, [2.5, [x]]], {a: {b: {c: [1e-3]}}}]
"""

ADVERSARIAL = {
    "anchor and alias": "a: &x [1.5, 2]\nb: *x\nc: &y {k: 1}\nd: *y\n",
    "merge key": "base: &b {x: 1, y: 2.5}\nderived:\n  <<: *b\n  y: 3\n",
    "value key": "=: 1\n",
    "recursive list": "a: &r [1, *r]\n",
    "recursive map": "a: &m {self: *m}\n",
    "complex key (unhashable: refused)": "? [1, 2]\n: x\n",
    "int tag on a word (refused)": "a: !!int x\n",
    "two documents (refused)": "a: 1\n---\nb: 2\n",
    "unclosed list (refused)": "a: [1, 2\n",
    "python object (refused)": "a: !!python/object/apply:os.system [ls]\n",
    "set": "s: !!set {a, b}\n",
    "omap": "o: !!omap [{a: 1}, {b: 2}]\n",
    "tuple": "t: !!python/tuple [1, 2.5, [3]]\n",
    "tuple with alias": "a: &x 1.5\nt: !!python/tuple [*x, *x]\n",
    "duplicate keys": "a: 1\na: 2.5\n",
    "top-level list": "- 1\n- 2.5\n",
    "top-level scalar": "1.5\n",
    "empty document": "",
}


# Block style, as PyYAML's dump writes frame files: the block route's shapes, and the lines next to them that
# must send a key's text (or the whole document) to the node route. Each is compared with the loader's value.
BLOCK = {
    "frame-like": "ego_speed: 35.1\nlidar_pose:\n- 1.5\n- -2.0\n- 0.0\nvehicles:\n  180:\n    angle:\n"
                  "    - 0.0\n    - -67.6\n    ass_id: -1\n    obj_type: Car\n  -3:\n    extent:\n      - 1.\n"
                  "      - 2.5e-3\n",
    "words the resolver reads as bool or null": "a: yes\nb: No\nc: null\nd: Null\non: 1\nn: y\nlist:\n- off\n",
    "numbers YAML 1.1 reads its own way": "a: 010\nb: 0x1F\nc: 1_000\nd: 1e5\ne: .5\nf: 1:30\ng: 00\nh: -0\n"
                                         "i: +0.0\nj: -.inf\nk: 1.0e400\n",
    "float and int keys": "1.5: a\n-7: b\n2.5e3:\n- 1\n",
    "empty value in the middle and at the end": "a:\nb: 1\nc:\n  d:\ne:\n",
    "plain scalar continued on a deeper line": "a: 1\n  2\nb:\n- 1\n  - 2\nc: x\n  y: z\n",
    "over-indented sibling (refused)": "a:\n    b: 1\n  c: 2\n",
    "list item among keys (refused)": "a: 1\n- 2\n",
    "deeper list, then a key at its indentation (refused)": "a:\n  - 1\n  b: 2\n",
    "comment, blank line, trailing space": "a: 1 # one\n\nb:  2\nc: 3 \n# end\n",
    "CRLF and tabs": "a: 1\r\nb:\r\n- 2\r\nc:\t3\n",
    "document start marker": "---\na: 1\n",
    "document end marker, then a second document (refused)": "a: 1\n...\nb: 2\n",
    "flow list and quoted value beside block keys": "a: [1, 2.5]\nb:\n- 3.5\nc: 'x y'\nd: \"z\"\n",
    "flow mapping continued at column 0": "a: {x: 1,\nb: 2}\nc: 1\n",
    "unclosed flow mapping before a key (refused)": "a: {x: 1,\nb: 2\n",
    "block scalar, then a key": "a: |\n  text: 1\n  - 2\nb: 3\n",
    "anchor in one key, alias in another": "a:\n- &x 1.5\nb: *x\n",
    "alias with no anchor (refused)": "a: 1\nb: *x\n",
    "merge key at column 0": "a: 1\n<<: {b: 2}\n",
    "list of mappings and list of lists": "a:\n- x: 1\n  y: 2\nb:\n- - 1\n  - 2\n",
    "duplicate top-level keys, block and not": "a: 1\nb: [2]\na:\n- 3\nb: 4\n",
    "key with a colon in its value": "a: b:c\nd: http://x\n",
    "tagged value": "a: !!str 1.5\nb: !!float 2\n",
    "unicode word and BOM": "\ufeffa: 1\nb: caf\u00e9\n",
    "no final newline": "a:\n- 1.5",
    "a lone dash": "a: -\nb:\n-\n",
}


@pytest.mark.parametrize("name", sorted(BLOCK))
def test_block_style_documents_get_the_loaders_value(name):
    _same_as_loader(BLOCK[name])


def test_a_frame_written_by_yaml_dump_takes_the_block_route_key_by_key():
    """Every top-level key of the frame-like document is built by the block route; V2V4Real's tagged pose
    alone leaves it (for V2V4Real's key route, tested below), and the other keys of that document stay on it."""
    words = fast_yaml._BlockWords.of(Opv2vYamlLoader)
    for part in fast_yaml._top_level_parts(BLOCK["frame-like"]):
        fast_yaml._block_mapping(part, words)  # raises _NotBlock otherwise
    parts = fast_yaml._top_level_parts("ego_speed: 1.5\n" + NUMPY_POSE)
    blocks = []
    for part in parts:
        try:
            fast_yaml._block_mapping(part, fast_yaml._BlockWords.of(V2V4RealYamlLoader))
            blocks.append(part.split(":")[0])
        except fast_yaml._NotBlock:
            pass
    assert blocks == ["ego_speed", "speed"] and len(parts) == 3


def test_scalars_resolve_and_build_as_the_loader_does():
    _same_as_loader(SCALARS)


@pytest.mark.parametrize("name", sorted(ADVERSARIAL))
def test_documents_the_route_does_not_cover_get_the_loaders_value(name):
    _same_as_loader(ADVERSARIAL[name])


def test_aliases_of_plain_nodes_are_one_object_as_in_pyyaml():
    value = fast_yaml.load(ADVERSARIAL["anchor and alias"].encode(), Opv2vYamlLoader)
    assert value["a"] is value["b"] and value["c"] is value["d"]


@pytest.mark.parametrize("text", ["recursive list", "merge key", "value key", "complex key (unhashable: refused)"])
def test_uncovered_documents_are_handed_back(text):
    with pytest.raises(fast_yaml.HandBack):
        fast_yaml.load(ADVERSARIAL[text].encode(), Opv2vYamlLoader)


@pytest.mark.parametrize("name", [name for name in ADVERSARIAL if "refused" in name])
def test_refused_documents_are_one_data_error_line_naming_the_file(name, tmp_path):
    path = tmp_path / "000000.yaml"
    path.write_text(ADVERSARIAL[name])
    with pytest.raises(DataError) as error:
        load_opv2v_yaml(path)
    assert str(error.value).startswith(str(path)) and "\n" not in str(error.value)


NUMPY_POSE = """lidar_pose: !!python/object/apply:numpy.core.multiarray._reconstruct
  args:
  - !!python/name:numpy.ndarray ''
  - !!python/tuple
    - 0
  - !!binary |
    Yg==
  state: !!python/tuple
  - 1
  - !!python/tuple
    - 2
    - 2
  - !!python/object/apply:numpy.dtype
    args:
    - f8
    - false
    - true
    state: !!python/tuple
    - 3
    - <
    - null
    - null
    - null
    - -1
    - -1
    - 0
  - false
  - !!binary |
    AAAAAAAA8D8AAAAAAAAAQAAAAAAAAAhAAAAAAAAAEEA=
speed: 1.5
"""


def test_v2v4real_numpy_pose_is_built_by_its_constructor():
    value = _same_as_loader(NUMPY_POSE, V2V4RealYamlLoader)
    assert value["lidar_pose"].tolist() == [[1.0, 2.0], [3.0, 4.0]]


@pytest.mark.parametrize("fixture", ["toy_small", "toy_v2v4real"])
def test_every_toy_frame_yaml_is_built_as_the_loader_builds_it(fixture, request):
    root = request.getfixturevalue(fixture)
    loader = V2V4RealYamlLoader if fixture == "toy_v2v4real" else Opv2vYamlLoader
    paths = sorted(root.rglob("*.yaml"))
    assert len(paths) > 20
    for path in paths:
        data = path.read_bytes()
        # fast_yaml itself, not the hand-back: the frame files must take the fast route
        assert _typed(fast_yaml.load(data, loader)) == _typed(yaml.load(data, Loader=loader)), path


def test_a_timestamp_is_a_datetime_as_in_pyyaml():
    value = _same_as_loader("t: 2001-12-14 21:59:43.10\n")
    assert isinstance(value["t"], datetime.datetime)


def test_the_collector_is_on_again_after_a_document_and_after_a_hand_back():
    import gc
    assert gc.isenabled()
    fast_yaml.load(SCALARS.encode(), Opv2vYamlLoader)
    assert gc.isenabled()
    with pytest.raises(fast_yaml.HandBack):
        fast_yaml.load(ADVERSARIAL["merge key"].encode(), Opv2vYamlLoader)
    assert gc.isenabled()


# V2V4Real's key route: a numpy array exactly as yaml.dump writes it is read from its text (dumped_ndarray_key);
# every other form of the same key, and every damaged one, goes to the node route, which gives the loader's value
# or error. Each document is compared with yaml.load; `taken` says whether the key route must have read it.
def _dumped(array, key="lidar_pose"):
    return yaml.dump({key: array})


def _replace(text, old, new):
    assert old in text
    return text.replace(old, new)


POSE = np.arange(16.0).reshape(4, 4) * 0.37 - 2.0
KEY_ROUTE = {  # name -> (document, taken by the key route)
    "float64 4x4 (a V2V4Real pose)": (_dumped(POSE), True),
    "float64 Fortran order": (_dumped(np.asfortranarray(POSE[:3, :2])), True),
    "float32 2x3": (_dumped(POSE[:2, :3].astype(np.float32)), True),
    "int64 3 dims": (_dumped(np.arange(24, dtype=np.int64).reshape(2, 3, 4)), True),
    "int16, one dimension": (_dumped(np.arange(-3, 4, dtype=np.int16)), True),
    "numpy 1's module name": (_replace(_dumped(POSE), "numpy._core.", "numpy.core."), True),
    "a long base64 block (many lines)": (_dumped(np.linspace(0, 1, 64)), True),
    "another key": (_dumped(POSE, key="true_pose"), True),
    "big-endian (quoted '>')": (_dumped(POSE.astype(">f8")), False),
    "uint8 (quoted '|')": (_dumped(np.arange(5, dtype=np.uint8)), False),
    "empty array (empty binary)": (_dumped(np.zeros((0,))), False),
    "0-d array (empty shape)": (_dumped(np.array(2.5)), False),
    "a key the resolver reads as a bool": (_dumped(POSE, key="on"), False),
    "a key the resolver reads as null": (_dumped(POSE, key="null"), False),
    "CRLF line ends": (_dumped(POSE).replace("\n", "\r\n"), False),
    "a comment after the bytes": (_dumped(POSE) + "  # note\n", False),
    "a blank line after the bytes": (_dumped(POSE) + "\n", False),
    "no newline at the end": (_dumped(POSE).rstrip("\n"), False),
    "bytes one short (refused)": (_replace(_dumped(POSE[:1, :1]), "AAAAAAAAAMA=", "AAAAAAAAAA=="), False),
    "bytes of another shape (refused)": (_replace(_dumped(POSE), "    - 4\n    - 4\n", "    - 4\n    - 3\n"), False),
    "bad base64 padding (refused)": (_replace(_dumped(POSE[:1, :1]), "AAAAAAAAAMA=", "AAAAAAAAAMA"), False),
    # base64's lenient decoding reads this as the loader does: the key route gives the same array.
    "base64 with padding inside": (_replace(_dumped(POSE[:1, :1]), "AAAAAAAAAMA=", "AAAA=AAAAAMA="), True),
    "a dtype numpy cannot make (refused)": (_replace(_dumped(POSE), "    - f8\n", "    - f3\n"), False),
    "a complex dtype (refused)": (_replace(_dumped(POSE[:1, :2]), "    - f8\n", "    - c16\n"), False),
    "an indented continuation of the bytes": (_replace(_dumped(POSE), "\n    AAAA", "\n     AAAA"), False),
    "a flag of another form (True)": (_replace(_dumped(POSE), "  - false\n  - !!binary", "  - True\n  - !!binary"),
                                      False),
    "a keep-chomped block": (_replace(_dumped(POSE), "  - !!binary |\n    AAAA", "  - !!binary |+\n    AAAA"), False),
}


@pytest.mark.parametrize("name", sorted(KEY_ROUTE))
def test_numpy_arrays_get_the_loaders_value_whichever_route_reads_them(name):
    text, taken = KEY_ROUTE[name]
    document = "ego_speed: 1.5\n" + text + "vehicles:\n  0:\n    ass_id: -1\n"
    _same_as_loader(document, V2V4RealYamlLoader)
    key_part = fast_yaml._top_level_parts(document)[1]
    assert (dumped_ndarray_key(key_part) is not None) == taken


def test_the_key_route_reads_every_toy_v2v4real_pose(toy_v2v4real):
    paths = sorted(path for path in toy_v2v4real.rglob("*.yaml") if path.parent.name in ("0", "1"))
    assert len(paths) > 20
    for path in paths:
        text = path.read_text()
        [part] = [part for part in fast_yaml._top_level_parts(text) if part.startswith("lidar_pose:")]
        key, pose = dumped_ndarray_key(part)
        assert key == "lidar_pose" and pose.shape == (4, 4)
        assert _typed(pose) == _typed(yaml.load(text, Loader=V2V4RealYamlLoader)["lidar_pose"]), path

"""The pure checks behind validation: YAML documents, user regexes, locations,
Kubernetes values and the batch split."""

import re
from decimal import Decimal

import pytest
import yaml

from posttrain.api import batching, documents, kube_values, locations, model_shapes, patterns
from posttrain.api.documents import DocumentError, parse_documents


# -- YAML documents ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "data,message",
    [
        ("a: 1\n".encode("utf-16-le"), "UTF-16 text without a byte order mark"),
        ("a: 1\n".encode("utf-16-be"), "UTF-16 text without a byte order mark"),
        (b"[" * 100_000, "nest"),
        (b"{a: " * 1000, "nested deeper than 64"),
        (b"a: [unclosed\n", "did not find expected"),
        (b"a: 1\n" + b"#" * documents.MAX_BYTES, r"the file is 1\.00 MiB \(1048581 bytes\), over"),
        (b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
         b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
         b"e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n", "more than 100000 values"),
        (b"a: {<<: [1, 2]}\n", "merge key"),
    ],
)  # fmt: skip
def test_documents_refused_with_a_reason(data, message):
    with pytest.raises(DocumentError, match=message):
        parse_documents(data)


@pytest.mark.parametrize(
    "data",
    [
        "a: caf\xe9 \U0001f600\n".encode("utf-16"),  # Python writes its native order's BOM
        b"\xff\xfe" + "a: caf\xe9 \U0001f600\n".encode("utf-16-le"),
        b"\xfe\xff" + "a: caf\xe9 \U0001f600\n".encode("utf-16-be"),
        b"\xef\xbb\xbf" + "a: caf\xe9 \U0001f600\n".encode(),
    ],
)
def test_documents_with_a_byte_order_mark_read_as_kubectl_reads_them(data):
    """cli-runtime's FileVisitor decodes with BOMOverride(UTF-8): the BOM picks the
    encoding and is dropped."""
    assert parse_documents(data) == [{"a": "caf\xe9 \U0001f600"}]


@pytest.mark.parametrize(
    "data,field,message",
    [
        (b"spec:\n  image: !!binary '###'\n", "spec.image", "line 2, column 10: !!binary"),
        (b"a: [{b: " + b"[" * 70 + b"]" * 70 + b"}]\n", "a[0].b" + "[0]" * 61,
         "line 1, column 70: nested deeper than 64 levels"),
        (b"- {x: 1}\n- " + b"{k: " * 70 + b"1" + b"}" * 70 + b"\n", "[1]" + ".k" * 63,
         "nested deeper than 64"),
    ],
)  # fmt: skip
def test_document_limits_name_the_key_where_they_run_over(data, field, message):
    with pytest.raises(DocumentError, match=re.escape(message)) as e:
        parse_documents(data)
    assert e.value.field == field


def test_documents_read_as_kubectl_reads_them():
    text = b"""\
b: &b {x: 1, w: 2}
later: {x: 5, <<: *b}
earlier: {<<: *b, x: 5}
listed: {<<: [{x: 1}, {x: 2}]}
sexagesimal: 1:30
date: 2001-12-14
octal: 0755
"""
    (doc,) = parse_documents(text)
    assert doc["later"] == {"x": 1, "w": 2}  # the merge key stands after x: it wins
    assert doc["earlier"] == {"x": 5, "w": 2}
    assert doc["listed"] == {"x": 1}  # earlier maps of a merge list win
    assert doc["sexagesimal"] == "1:30" and doc["date"] == "2001-12-14"
    assert doc["octal"] == 493


# What kubectl 1.36 sends for each scalar (`kubectl create --dry-run=client -o json`).
KUBECTL_SENDS = [
    ("y", True), ("Y", True), ("yes", True), ("on", True), ("n", False), ("NO", False),
    ("off", False), ("0o10", 8), ("010", 8), ("08", 8), ("0x1F", 31), ("0b101", 5),
    ("1e3", 1000), ("8.0", 8), ("1_000", 1000), ("+12", 12), (".5", 0.5), ("1.", 1),
    ("-0", 0), ("1e400", "1e400"), ("12345678901234567890123", 1.2345678901234568e22),
    ("2001-12-14", "2001-12-14"), ("1:30", "1:30"), ("!!binary aGk=", "hi"),
    ("!!str 1", "1"), ("!!int '3'", 3), ("!!float 1", 1), ("'y'", "y"),
]  # fmt: skip


@pytest.mark.parametrize("scalar,sent", KUBECTL_SENDS, ids=[s for s, _ in KUBECTL_SENDS])
def test_scalars_read_as_kubectl_sends_them(scalar, sent):
    (doc,) = parse_documents(f"v: {scalar}\n".encode())
    assert doc == {"v": sent} and type(doc["v"]) is type(sent)


def test_nulls_duplicates_and_bytes_as_kubectl_sends_them():
    (doc,) = parse_documents(b"a: 1\na: 2\nn: 1\nb: null\nc: ~\nd: [1, null]\ne: \xff\xfex\n")
    assert doc == {"a": 2, False: 1, "d": [1, None], "e": "\ufffd\ufffdx"}


def test_yaml_errors_name_line_and_column_not_a_string():
    with pytest.raises(DocumentError) as e:
        parse_documents(b"spec:\n  training: {steps: 10\n  x: 1\n")
    assert "<unicode string>" not in str(e.value) and "line 3, column" in str(e.value)


def test_an_alias_bomb_names_the_key_it_expands_under():
    bomb = b"a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + b"".join(
        f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n".encode()
        for p, c in zip("abcd", "bcde", strict=True)
    )
    with pytest.raises(DocumentError) as e:
        parse_documents(b"spec:\n  data:\n    columns:\n" + b"".join(
            b"      " + line + b"\n" for line in bomb.splitlines()))  # fmt: skip
    assert e.value.field.startswith("spec.data.columns.")


def test_large_documents_are_parsed_by_libyaml():
    """libyaml's C parser, not PyYAML's pure-Python one (18 s for 200k labels); how fast is
    a benchmark's question, not a test's."""
    assert issubclass(documents._Loader, yaml.CSafeLoader)
    text = ("labels:\n" + "".join(f"  k{i}: v\n" for i in range(40_000))).encode()
    (doc,) = parse_documents(text)
    assert len(doc["labels"]) == 40_000


# -- user regexes -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "pattern,problem",
    [
        ("a{4294967296}", "too large"),
        ("(" * 1000, "not a valid regular expression"),
        ("(" * 40 + ")" * 40, "deeper than 32"),
        ("(a+)+", "quantifier inside a repeated group"),
        ("(?:a?){30}a{30}", "quantifier inside a repeated group"),
        ("(x*y?)*z", "quantifier inside a repeated group"),
        ("a{1001}", "more than 1000"),
        ("q_proj(", "not a valid regular expression"),
        ("(.*)(.*)(.*)(.*)(.*)X", "one after another"),  # 39 s on 80 characters
        (r"\w+\w+X", "one after another"),
        (r".*\s*X", "one after another"),
        (".{0,500}.{0,500}x", "one after another"),
        (".*a.*a.*aX", "3 long repeats over (almost) any character"),
        # alternatives under a repeat that split the text in many ways
        ("(a|a)*X", "alternatives inside a repeated group"),  # 1.9 s on 24 characters
        ("(a|ab)*c", "alternatives inside a repeated group"),
        ("(a|aa)+$", "alternatives inside a repeated group"),
        ("(ab|a|b)*c", "alternatives inside a repeated group"),
        ("(foo|fo|o)*X", "alternatives inside a repeated group"),
        (r"(\d|\d\d)+$", "alternatives inside a repeated group"),
        ("((a|b)|a)*X", "alternatives inside a repeated group"),
        ("(a|)*X", "alternatives inside a repeated group"),
        ("(x|xy|y){2,50}z", "alternatives inside a repeated group"),
    ],
)
def test_dangerous_regexes_refused(pattern, problem):
    assert problem in (patterns.regex_error(pattern) or "")
    with pytest.raises(ValueError, match="spec.lora.targetModules"):
        patterns.compile_user_regex(pattern, "spec.lora.targetModules")


@pytest.mark.parametrize(
    "pattern",
    ["q_proj", r"(.*/)?(q_proj|v_proj)", r"layers/\d+/attn/q_proj", r"<answer>\s*\d+</answer>",
     r"(ab{2})+", "a{2,1000}", r"^<think>.*</think>\s*<answer>.*</answer>$", r"\S+\s+\S+",
     r"\d+\D+", r"(\w+)\s+(\w+)", r"[^<]*<[^>]*>", "(?:yes|no)+", "(cat|dog)+",
     r"(<b>|<i>)*x"],
)  # fmt: skip
def test_ordinary_regexes_accepted(pattern):
    assert patterns.regex_error(pattern) is None


# Forms that take exponential time in backtracking engines, which Python's parser makes
# single-character classes or splits no other way: accepted, and they finish.
@pytest.mark.parametrize(
    "pattern,text",
    [(r"(\w|\d)+$", "1" * 5000 + "!"), (r"(.|\n)*X", "a\n" * 2500), (r"(a|\w)*X", "a" * 5000),
     (r"(\s|\S)*X", "a " * 2500), ("(cat|dog)+X", "cat" * 2000)],
)  # fmt: skip
def test_alternatives_python_reads_as_one_class_are_accepted_and_finish(pattern, text):
    import signal

    def hung(*_):
        raise AssertionError(f"{pattern} did not finish in 10 s")

    assert patterns.regex_error(pattern) is None
    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(10)  # a guard against a hang (sre checks signals), not a timing
    try:
        assert patterns.compile_user_regex(pattern, "f").search(text) is None
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# -- locations --------------------------------------------------------------------------
P, G, F = locations.PATH, locations.GS, locations.HF
MODEL = (P, G, F)


@pytest.mark.parametrize(
    "value,kinds,problem",
    [
        ("hf://user:TOKEN@org/name", MODEL, "hfTokenSecret"),
        ("gs://key:secret@bucket/x", MODEL, "hfTokenSecret"),
        ("https://u:p@host/x", MODEL, "hfTokenSecret"),
        ("file:///models/x", MODEL, "file:// is not supported"),
        ("s3://bucket/x", MODEL, "s3:// is not supported"),
        ("gs:///x", MODEL, "needs a bucket"),
        ("gs://169.254.169.254/x", MODEL, "IP address"),
        ("gs://metadata.google.internal/x", MODEL, "google"),
        ("hf://org/name", (P, G), "hf:// is not supported"),
        ("/models/x", (G,), "must be gs://"),
        ("/data/../etc/passwd", MODEL, "'..'"),
        ("gs://bucket/a/../b", MODEL, "'..'"),
        ("/m/\x00", MODEL, "\\x00"),
        ("/m/\u202ex", MODEL, "\\u202e"),
        ("/m/a b", MODEL, "a space"),
        ("hf://org/name?revision=x", MODEL, "query string"),
        ("hf://org", MODEL, "hf://org/name"),
        ("mailto:x", MODEL, "not a supported scheme"),
    ],
)
def test_locations_refused(value, kinds, problem):
    assert problem in (locations.location_error(value, kinds) or "")


@pytest.mark.parametrize(
    "value", ["/models/tiny", "runs/sft", "gs://my-runs/q/1", "hf://Qwen/Qwen3-0.6B",
              "hf://Qwen/Qwen3-0.6B@main", "hf://org/name@refs/pr/1", "C:relative"],
)  # fmt: skip
def test_locations_accepted(value):
    assert locations.location_error(value, MODEL) is None


@pytest.mark.parametrize(
    "path,ok",
    [("/outputs", True), ("/", False), ("/etc/posttrain", False), ("/outputs/../etc", False),
     ("/var/run/secrets/kubernetes.io/serviceaccount", False), ("/proc/1", False)],
)  # fmt: skip
def test_mount_paths(path, ok):
    assert (locations.mount_path_error(path) is None) == ok


def test_image_references():
    assert locations.image_error("us-docker.pkg.dev/p/r/trainer:1.2") is None
    assert locations.image_error("ghcr.io/x/y@sha256:" + "a" * 64) is None
    assert locations.image_error("localhost:5000/trainer") is None
    assert "no scheme" in locations.image_error("https://ghcr.io/x")
    assert "a space" in locations.image_error("x:1 --privileged")


# -- Kubernetes values ------------------------------------------------------------------
@pytest.mark.parametrize(
    "text,value",
    [("8", 8), ("500m", Decimal("0.5")), ("64Gi", 64 * 2**30), ("1.5G", Decimal("1.5e9")),
     ("1e3", 1000), (".5", Decimal("0.5"))],
)  # fmt: skip
def test_parse_quantity(text, value):
    assert kube_values.parse_quantity(text) == value


@pytest.mark.parametrize("text", ["lots", "-2", "0", "64GB", "1e99999", "", "8 "])
def test_bad_quantities(text):
    assert kube_values.quantity_error(text) is not None


def test_priority_class_names():
    assert kube_values.priority_class_error("batch-high") is None
    assert "reserved" in kube_values.priority_class_error("system-node-critical")
    assert kube_values.priority_class_error("High") is not None
    assert not kube_values.matches(kube_values.DNS_LABEL, "adv-nl\n")


# -- the batch split, the one rule admission and the trainer share ------------------------
@pytest.mark.parametrize(
    "batch,accumulation,hosts,devices,rows,problem",
    [
        (8, 1, 1, 8, 1, None),
        (6, 1, 4, 16, 1, "multiple of the number of hosts (4)"),
        (32, 16, 4, 16, 1, "per-host batch"),
        (24, 1, 4, 16, 1, "do not split over the 16 devices"),
        (4, 1, 4, 16, 4, None),  # GRPO: 4 prompts x 4 generations = 16 rows
        (3, 1, 1, 8, 1, None),  # one host may replicate
    ],
)
def test_batch_split(batch, accumulation, hosts, devices, rows, problem):
    error = batching.batch_split_error(batch, accumulation, hosts, devices, rows)
    assert (error is None) if problem is None else problem in error


def test_hidden_sizes_from_model_names():
    assert model_shapes.hidden_size("hf://Qwen/Qwen3-0.6B@main") == 1024
    assert model_shapes.hidden_size("gs://m/SmolLM2-135M-Instruct") == 576
    assert model_shapes.hidden_size("/models/Qwen3-14B") == 5120
    assert model_shapes.hidden_size("/models/tiny") is None

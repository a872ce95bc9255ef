#!/usr/bin/env python3
"""Build testdata/proto_field_numbers.json from a copy of Calico's felixbackend.proto.

Usage:
    python3 proto/tools/extract_field_numbers.py CALICO_PROTO SOURCE_JSON > testdata/proto_field_numbers.json

CALICO_PROTO is a local copy of Calico's felix/proto/felixbackend.proto (not kept in this repo).
SOURCE_JSON is a JSON object that is stored verbatim under the "source" key (where the copy came
from: repository, commit, path, and any notes).

protoc does the parsing: it compiles the file to a FileDescriptorSet and decodes that to text
format, which this script reads. Output keys:

  "Message" / "Outer.Inner"  -> {field_name: number}          (map-entry messages are left out)
  "Enum" / "Outer.Enum"      -> {VALUE_NAME: number}
  "field_types"              -> {message: {field: {label, type, type_name?, oneof?, map?}}}
  "reserved"                 -> {message: {"numbers": [...], "names": [...]}}
  "source"                   -> SOURCE_JSON
"""

import json
import os
import subprocess
import sys
import tempfile


def tokenize(text):
    """Yield (key, value) pairs and block markers from protobuf text format."""
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line == "}":
            yield ("}", None)
        elif line.endswith("{"):
            yield ("{", line[:-1].strip())
        else:
            key, _, value = line.partition(":")
            value = value.strip()
            if value.startswith('"'):
                value = json.loads(value)
            elif value.lstrip("-").isdigit():
                value = int(value)
            yield (key.strip(), value)


def parse(tokens):
    """Parse into nested dicts; every key maps to a list of values."""
    node = {}
    for key, value in tokens:
        if key == "}":
            return node
        if key == "{":
            node.setdefault(value, []).append(parse(tokens))
        else:
            node.setdefault(key, []).append(value)
    return node


def one(node, key, default=None):
    values = node.get(key)
    return values[0] if values else default


def walk_message(msg, prefix, out, types, reserved, map_entries):
    name = prefix + one(msg, "name")
    options = one(msg, "options", {})
    if one(options, "map_entry", False) in (True, "true"):
        return
    oneofs = [one(o, "name") for o in msg.get("oneof_decl", [])]
    numbers = {}
    field_types = {}
    for field in msg.get("field", []):
        fname = one(field, "name")
        numbers[fname] = one(field, "number")
        info = {"label": one(field, "label"), "type": one(field, "type")}
        if one(field, "type_name") is not None:
            info["type_name"] = one(field, "type_name")
        if one(field, "oneof_index") is not None:
            info["oneof"] = oneofs[one(field, "oneof_index")]
        entry = map_entries.get(info.get("type_name"))
        if entry is not None:
            info["map"] = entry
        field_types[fname] = info
    out[name] = numbers
    types[name] = field_types
    res_numbers = []
    for rng in msg.get("reserved_range", []):
        # Descriptor ranges are [start, end).
        res_numbers.extend(range(one(rng, "start"), one(rng, "end")))
    res_names = list(msg.get("reserved_name", []))
    if res_numbers or res_names:
        reserved[name] = {"numbers": res_numbers, "names": res_names}
    for enum in msg.get("enum_type", []):
        walk_enum(enum, name + ".", out)
    for nested in msg.get("nested_type", []):
        walk_message(nested, name + ".", out, types, reserved, map_entries)


def walk_enum(enum, prefix, out):
    out[prefix + one(enum, "name")] = {
        one(v, "name"): one(v, "number") for v in enum.get("value", [])
    }


def collect_map_entries(msg, prefix, package, acc):
    name = prefix + one(msg, "name")
    options = one(msg, "options", {})
    if one(options, "map_entry", False) in (True, "true"):
        fields = {one(f, "name"): f for f in msg.get("field", [])}
        acc["." + package + "." + name] = {
            "key": one(fields["key"], "type"),
            "value": one(fields["value"], "type"),
            **(
                {"value_type_name": one(fields["value"], "type_name")}
                if one(fields["value"], "type_name")
                else {}
            ),
        }
    for nested in msg.get("nested_type", []):
        collect_map_entries(nested, name + ".", package, acc)


def main():
    proto_path, source_path = sys.argv[1], sys.argv[2]
    with open(source_path, encoding="utf-8") as f:
        source = json.load(f)
    include = os.path.dirname(os.path.abspath(proto_path))
    with tempfile.TemporaryDirectory() as tmp:
        desc = os.path.join(tmp, "set.bin")
        subprocess.run(
            ["protoc", "-I", include, "--descriptor_set_out=" + desc,
             os.path.basename(proto_path)],
            check=True,
        )
        with open(desc, "rb") as f:
            text = subprocess.run(
                ["protoc", "-I/usr/include",
                 "--decode=google.protobuf.FileDescriptorSet",
                 "google/protobuf/descriptor.proto"],
                stdin=f, check=True, capture_output=True,
            ).stdout.decode()
    root = parse(iter(list(tokenize(text))))
    (fileproto,) = root["file"]
    package = one(fileproto, "package")
    map_entries = {}
    for msg in fileproto.get("message_type", []):
        collect_map_entries(msg, "", package, map_entries)
    out, types, reserved = {}, {}, {}
    for enum in fileproto.get("enum_type", []):
        walk_enum(enum, "", out)
    for msg in fileproto.get("message_type", []):
        walk_message(msg, "", out, types, reserved, map_entries)
    result = {"source": source}
    result.update(dict(sorted(out.items())))
    result["field_types"] = dict(sorted(types.items()))
    result["reserved"] = dict(sorted(reserved.items()))
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()

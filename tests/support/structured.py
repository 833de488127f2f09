"""Structured-output cases the engine, server and router tests share: JSON schemas (each with the
chat prompt that asks for it) and regexes, and the checks that an output satisfies them."""

from __future__ import annotations

import json
import re

NAME = {"type": "string", "maxLength": 24}
SCORE = {"type": "number", "minimum": 0, "maximum": 10}

# (what the prompt asks for, the schema). Nested objects, arrays, enums, bounded numbers, required
# fields, anyOf, const, nullable fields; strings are length-bounded where a small model could
# otherwise ramble past max_new_tokens.
SCHEMAS: list[tuple[str, dict]] = [
    ("a person", {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["name", "age"]}),
    ("a yes or no answer", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("a colour", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]}),
    ("a temperature reading", {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                                                                "unit": {"const": "C"}}, "required": ["celsius", "unit"]}),
    ("three tags", {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                              "minItems": 3, "maxItems": 3}}, "required": ["tags"]}),
    ("a list of scores", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 5}, "minItems": 1,
                          "maxItems": 6}),
    ("an address", {"type": "object", "properties": {
        "street": NAME, "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["street", "city", "zip"]}),
    ("a user with an address", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"name": NAME, "address": {
            "type": "object", "properties": {"city": NAME, "country": {"enum": ["US", "FR", "JP"]}},
            "required": ["city", "country"]}}, "required": ["name", "address"]}},
        "required": ["user"]}),
    ("a product", {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999}, "title": NAME,
        "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000}, "in_stock": {"type": "boolean"}},
        "required": ["id", "title", "price", "in_stock"]}),
    ("a shape", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "radius": SCORE}, "required": ["kind", "radius"]},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": SCORE}, "required": ["kind", "side"]}]}),
    ("an id, either a number or a code", {"type": "object", "properties": {"id": {"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 100}, {"type": "string", "pattern": "^[A-Z]{3}$"}]}},
        "required": ["id"]}),
    ("a matrix", {"type": "object", "properties": {"rows": {"type": "array", "maxItems": 3, "items": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2, "maxItems": 2}}},
        "required": ["rows"]}),
    ("a todo list", {"type": "object", "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "object", "properties": {"task": NAME, "done": {"type": "boolean"}}, "required": ["task", "done"]}}},
        "required": ["items"]}),
    ("an event with an optional note", {"type": "object", "properties": {
        "event": NAME, "day": {"type": "integer", "minimum": 1, "maximum": 31},
        "note": {"type": ["string", "null"], "maxLength": 20}}, "required": ["event", "day", "note"]}),
    ("a rating", {"type": "object", "properties": {"stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]},
                                                   "comment": {"type": "string", "maxLength": 30}},
                  "required": ["stars", "comment"]}),
    ("a point", {"type": "object", "properties": {"x": SCORE, "y": SCORE}, "required": ["x", "y"],
                 "additionalProperties": False}),
    ("a book", {"type": "object", "properties": {
        "title": NAME, "author": NAME, "year": {"type": "integer", "minimum": 1450, "maximum": 2030},
        "genres": {"type": "array", "items": {"enum": ["fiction", "poetry", "science", "history"]}, "maxItems": 2}},
        "required": ["title", "author", "year", "genres"]}),
    ("a status", {"enum": ["ok", "degraded", "down"]}),
    ("a number between 0 and 1", {"type": "number", "minimum": 0, "maximum": 1}),
    ("a weather report", {"type": "object", "properties": {
        "city": NAME, "forecast": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"day": {"enum": ["mon", "tue", "wed"]},
                                             "rain": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["day", "rain"]}}}, "required": ["city", "forecast"]}),
    ("a login", {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "role": {"enum": ["admin", "user"]}}, "required": ["email", "role"]}),
    ("a pair of an integer and a string", {"type": "array", "prefixItems": [
        {"type": "integer", "minimum": 0, "maximum": 10}, {"type": "string", "maxLength": 10}], "items": False,
        "minItems": 2}),
]

# (what the prompt asks for, a regex the whole output must match)
REGEXES: list[tuple[str, str]] = [
    ("a phone number", r"\d{3}-\d{4}"),
    ("a date", r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"),
    ("an IPv4 address", r"((25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(25[0-5]|2[0-4]\d|1?\d?\d)"),
    ("yes or no", r"(yes|no)"),
    ("a capitalised word", r"[A-Z][a-z]{2,9}"),
    ("a time", r"([01]\d|2[0-3]):[0-5]\d"),
    ("a hex colour", r"#[0-9a-f]{6}"),
    ("an email address", r"[a-z]{1,10}@[a-z]{1,10}\.(com|org|net)"),
    ("a price", r"\$[1-9]\d{0,3}\.\d{2}"),
    ("three words", r"[a-z]{1,8} [a-z]{1,8} [a-z]{1,8}"),
]


def chat_prompt(tokenizer, what: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": f"Answer with {what}."}], tokenize=False,
                                         add_generation_prompt=True)


def assert_valid_json(text: str, schema: dict, label: str = "") -> None:
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError as e:
        raise AssertionError(f"{label}: output is not JSON ({e}): {text!r}") from None
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{label}: output {text!r} breaks its schema: {e.message}") from None


def assert_full_match(text: str, pattern: str, label: str = "") -> None:
    assert re.fullmatch(pattern, text), f"{label}: output {text!r} does not match {pattern!r}"


def chat_completions_json(post, cases, temperature: float, max_tokens: int = 200) -> None:
    """`post(path, body) -> (status, text)` each (what, schema) to a router as /v1/chat/completions
    with response_format json_schema, all at once; every reply must be JSON valid against its schema."""
    import threading

    replies: dict[int, tuple[int, str]] = {}

    def one(i):
        what, schema = cases[i]
        replies[i] = post("/v1/chat/completions", {
            "model": "smollm2", "messages": [{"role": "user", "content": f"Answer with {what}."}],
            "max_tokens": max_tokens, "temperature": temperature,
            "response_format": {"type": "json_schema", "json_schema": {"name": f"case{i}", "schema": schema}}})

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for i, (what, schema) in enumerate(cases):
        status, body = replies[i]
        assert status == 200, body
        choice = json.loads(body)["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert_valid_json(choice["message"]["content"], schema, what)

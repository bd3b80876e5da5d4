"""Whether a JSON schema allows any finite JSON value: a schema that does not is refused.

`{"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}` allows only
`{"a": {"a": ...}}` without end. llguidance takes its first steps happily (`{"a": ` is a
prefix of every value it allows), so the model writes until `max_tokens` and the request ends
with "length" on output that no completion could make valid. Grammars say the same of an
empty language only when no first token exists (server/sampling/grammar.py's first-step probe).

The check is the productive-nonterminal fixpoint of a context-free grammar, done on the schema:
each schema is a gate, true when it may have a finite instance. A schema is the AND of its
`$ref` target, its `allOf` members, an OR over its `anyOf` / `oneOf` members and an OR over the
types it allows: a scalar type, `enum` or `const` is a finite value at once; an array needs
each of its first `minItems` positions (and a `contains`) satisfiable, an object each
`required` property's schema. Gates start false and turn true as their inputs do (linear in the
schema's size); what stays false has no finite instance. Every gate asks only for conditions
that an instance must meet, and any keyword the check does not model is taken as satisfiable,
so a schema refused here has no finite instance under the JSON Schema semantics, whatever the
keywords it leaves out would say; the converse is not claimed (`minLength` above `maxLength`
passes here, llguidance's first step catches that one).
"""

from __future__ import annotations

import json
from typing import Any

from toppings.server.sampling.schema_refs import is_local_pointer, resolve_pointer, subschemas

SCALAR_TYPES = frozenset({"null", "boolean", "integer", "number", "string"})
ALL_TYPES = SCALAR_TYPES | {"array", "object"}
AND, OR = True, False  # a gate's kind: AND (true when every input is) or OR (when any is)


def has_finite_instance(schema_text: str) -> bool:
    """Whether the JSON schema `schema_text` may allow a finite value (False: it surely does
    not). A schema that moves the base of its refs (a nested `$id`) or uses dynamic refs is
    not analysed (True)."""
    schema = json.loads(schema_text)
    if _moves_base(schema, is_root=True):
        return True
    return _Circuit(schema).is_true(0)


def _moves_base(schema: Any, is_root: bool) -> bool:
    if not isinstance(schema, dict):
        return False
    if "$dynamicRef" in schema or "$recursiveRef" in schema:
        return True
    if not is_root and isinstance(schema.get("$id"), str):
        return True
    return any(_moves_base(sub, is_root=False) for _, sub in subschemas(schema))


class _Circuit:
    """The AND/OR gates of one schema document; gate 0 is the document's root."""

    def __init__(self, document: Any):
        self.document = document
        self.kinds: list[bool] = []
        self.inputs: list[list[int]] = []
        self._of_schema: dict[int, int] = {}  # id(schema object) -> its gate
        self._pending: list[tuple[int, Any]] = []
        self._gate_of(document)
        while self._pending:
            gate, schema = self._pending.pop()
            self.inputs[gate] = self._schema_inputs(schema)

    def _new(self, kind: bool, inputs: list[int]) -> int:
        self.kinds.append(kind)
        self.inputs.append(inputs)
        return len(self.kinds) - 1

    def _gate_of(self, schema: Any) -> int:
        """The gate of a schema object (made once: refs to it share it, cycles included)."""
        if schema is True or not isinstance(schema, (dict, bool)):
            return self._new(AND, [])  # true, or not a schema: not modelled, satisfiable
        if schema is False:
            return self._new(OR, [])
        gate = self._of_schema.get(id(schema))
        if gate is None:
            gate = self._of_schema[id(schema)] = self._new(AND, [])
            self._pending.append((gate, schema))
        return gate

    def _schema_inputs(self, schema: dict) -> list[int]:
        inputs = []
        ref = schema.get("$ref")
        if is_local_pointer(ref):
            try:
                inputs.append(self._gate_of(resolve_pointer(self.document, ref)))
            except KeyError:
                pass  # llguidance refuses it with its own message
        for sub in _list(schema.get("allOf")):
            inputs.append(self._gate_of(sub))
        for key in ("anyOf", "oneOf"):
            if isinstance(schema.get(key), list):
                inputs.append(self._new(OR, [self._gate_of(s) for s in schema[key]]))
        inputs.append(self._types(schema))
        return inputs

    def _types(self, schema: dict) -> int:
        """The OR over the types the schema allows, each with what its instance needs."""
        if "enum" in schema or "const" in schema:
            return self._new(AND, [])
        types = schema.get("type", list(ALL_TYPES))
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or any(t not in ALL_TYPES for t in types):
            return self._new(AND, [])  # malformed: llguidance's to judge
        if SCALAR_TYPES.intersection(types):
            return self._new(AND, [])
        options = []
        if "array" in types:
            options.append(self._new(AND, self._array_needs(schema)))
        if "object" in types:
            options.append(self._new(AND, self._object_needs(schema)))
        return self._new(OR, options)

    def _array_needs(self, schema: dict) -> list[int]:
        """The schemas the items of the shortest allowed array must meet."""
        min_items = _count(schema.get("minItems"))
        items = schema.get("items", True)
        if isinstance(schema.get("prefixItems"), list):
            prefix, rest = schema["prefixItems"], items
        elif isinstance(items, list):  # drafts before 2020-12
            prefix, rest = items, schema.get("additionalItems", True)
        else:
            prefix, rest = [], items
        needs = [self._gate_of(s) for s in prefix[:min_items]]
        if min_items > len(prefix):
            needs.append(self._gate_of(rest))
        if "contains" in schema and _count(schema.get("minContains", 1)) > 0:
            needs.append(self._gate_of(schema["contains"]))
        return needs

    def _object_needs(self, schema: dict) -> list[int]:
        """The schemas the required properties' values must meet (a name a pattern may match
        is not modelled: regex dialects differ)."""
        properties = schema.get("properties")
        properties = properties if isinstance(properties, dict) else {}
        needs = []
        for name in _list(schema.get("required")):
            if name in properties:
                needs.append(self._gate_of(properties[name]))
            elif not schema.get("patternProperties"):
                needs.append(self._gate_of(schema.get("additionalProperties", True)))
        return needs

    def is_true(self, goal: int) -> bool:
        """Whether gate `goal` turns true (the least fixpoint, by counting inputs)."""
        readers: list[list[int]] = [[] for _ in self.kinds]
        pairs = zip(self.kinds, self.inputs)
        waiting = [len(inputs) if kind is AND else 1 for kind, inputs in pairs]
        for gate, inputs in enumerate(self.inputs):
            for source in inputs:
                readers[source].append(gate)
        true = [False] * len(self.kinds)
        ready = [g for g, kind in enumerate(self.kinds) if kind is AND and not self.inputs[g]]
        for gate in ready:
            true[gate] = True
        while ready:
            for reader in readers[ready.pop()]:
                waiting[reader] -= 1
                if waiting[reader] == 0 and not true[reader]:
                    true[reader] = True
                    ready.append(reader)
        return true[goal]


def _list(value: Any) -> list:
    return value if isinstance(value, list) else []


def _count(value: Any) -> int:
    """A non-negative count keyword's value (0 when absent or malformed)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0

"""Cut the schemas tfserve answers with out of OpenAI's published OpenAPI document.

    git clone https://github.com/openai/openai-openapi && python extract.py openai-openapi/openapi.json COMMIT

writes `openai-subset.json` beside this file: the component schemas below and every schema they reach
through `$ref`, under `components.schemas` (so their `#/components/schemas/X` refs still resolve). The one
change: OpenAPI 3.0's `nullable: true`, which the document still uses in a few places and JSON Schema
ignores, becomes what it means, `anyOf: [the schema, {"type": "null"}]`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOTS = ["CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse",
         "ListModelsResponse", "Model", "ErrorResponse", "Response", "ResponseStreamEvent", "CreateEmbeddingResponse"]


def referenced(value, found: set[str]) -> None:
    if isinstance(value, dict):
        for key, child in value.items():
            if key == "$ref" and isinstance(child, str) and child.startswith("#/components/schemas/"):
                found.add(child.rsplit("/", 1)[1])
            else:
                referenced(child, found)
    elif isinstance(value, list):
        for child in value:
            referenced(child, found)


def null_as_type(value):
    """`nullable: true` -> an explicit union with null, everywhere in `value`."""
    if isinstance(value, list):
        return [null_as_type(child) for child in value]
    if not isinstance(value, dict):
        return value
    value = {key: null_as_type(child) for key, child in value.items()}
    if value.pop("nullable", False):
        description = value.pop("description", None)
        value = {"anyOf": [value, {"type": "null"}], **({"description": description} if description else {})}
    return value


def extract(document: dict) -> dict:
    schemas = document["components"]["schemas"]
    keep, todo = set(), list(ROOTS)
    while todo:
        name = todo.pop()
        if name not in keep:
            keep.add(name)
            found: set[str] = set()
            referenced(schemas[name], found)
            todo.extend(found - keep)
    return {name: null_as_type(schemas[name]) for name in sorted(keep)}


def main(source: str, commit: str) -> None:
    document = json.loads(Path(source).read_text())
    subset = {"info": {"source": "https://github.com/openai/openai-openapi", "commit": commit,
                       "openapi": document["openapi"], "roots": ROOTS},
              "components": {"schemas": extract(document)}}
    out = Path(__file__).with_name("openai-subset.json")
    out.write_text(json.dumps(subset, sort_keys=True, separators=(",", ":")) + "\n")
    print(f"{out}: {len(subset['components']['schemas'])} schemas, {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:3])

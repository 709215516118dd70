"""``ApiModel``, the base of every spec model, and the small models more than one block uses.

Conventions (every model of the MegatronJob API follows them):
- Python attributes are snake_case; the wire names (aliases) are the Kubernetes camelCase names.
- An optional field without a default is *omitted* when unset. ``null`` is refused everywhere
  (omit the field instead): CEL's ``has()`` is true for an explicit null, so accepting nulls would
  make every rule need a second guard, and the API server would otherwise treat them differently.
- Unknown fields are errors (``extra="forbid"``): a typo must never be silently dropped.
"""

from __future__ import annotations

import typing
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

from .patterns import CONFIG_KEY, DNS_LABEL, ENV_NAME, QUANTITY

Quantity = Annotated[
    Annotated[int, Field(ge=0, le=2**50)] | Annotated[str, Field(pattern=QUANTITY, max_length=32)],
    Field(json_schema_extra={"x-kubernetes-int-or-string": True}),
]


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X | None``, ``list[X]``, ...), or None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = model_in(arg)
        if found is not None:
            return found
    return None


class ApiModel(BaseModel):
    """Base: camelCase wire names, unknown fields and nulls refused."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_default=False,
        frozen=False,
        # Types as the API server applies them: numNodes: "1" or suspend: "yes" are errors, not coerced.
        strict=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            nulls = sorted(k for k, v in data.items() if v is None)
            if nulls:
                raise PydanticCustomError(
                    "null_field", "{fields}: null is not allowed; omit the field instead",
                    {"fields": ", ".join(str(k) for k in nulls)},
                )
        return data

    def wire(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset optional fields omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# --------------------------------------------------------------------------------------------
# Environment variables: the trainer's (spec.env) and those of spec.pod's containers
# --------------------------------------------------------------------------------------------


class SecretKeyRef(ApiModel):
    name: str = Field(..., max_length=253, pattern=DNS_LABEL)
    key: str = Field(..., max_length=253, pattern=CONFIG_KEY)
    optional: bool | None = None


class EnvValueFrom(ApiModel):
    """Only Secret and ConfigMap keys; the pod reads them, the operator never does."""

    secret_key_ref: SecretKeyRef | None = None
    config_map_key_ref: SecretKeyRef | None = None


class EnvVar(ApiModel):
    name: str = Field(..., max_length=256, pattern=ENV_NAME)
    value: str | None = Field(None, max_length=4096)
    value_from: EnvValueFrom | None = None

"""tokenmill.plan: throughput, batch-size and cost ceilings from first principles.

Depends only on tokenmill.cost, tokenmill.environment and tokenmill.formats (no torch). Pure functions
over frozen dataclasses: ``load_model`` -> ModelSpec, ``get_hardware`` -> HardwareSpec, ``make_plan`` -> Plan.
"""

from .catalog import CATALOG, get_hardware
from .errors import PlanError
from .hardware import HardwareSpec
from .model_specs import ModelSpec, load_model, param_counts, preset
from .roofline import Plan, PlanConfig, PlanPoint, make_plan

__all__ = ["CATALOG", "HardwareSpec", "ModelSpec", "Plan", "PlanConfig", "PlanError",
           "PlanPoint", "get_hardware", "load_model", "make_plan", "param_counts", "preset"]

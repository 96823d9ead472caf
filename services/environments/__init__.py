"""Environments for multi-turn agents: the interface (``base``), a gymnasium adapter and the built-in ones.

A job names its environment as ``package.module:factory``; ``load_environment_factory`` finds it and
``make_environment`` builds it.
"""

from services.environments.base import (
    Environment,
    EnvironmentFailure,
    Observation,
    StepResult,
    call_maybe_async,
    check_reset_result,
    check_step_result,
    encode_observation,
    observation_problem,
)
from services.environments.calculator import CalculatorEnvironment, calculator
from services.environments.factory import load_environment_factory, make_environment
from services.environments.randomwalks import InteractiveRandomWalks, interactive_randomwalks

__all__ = [
    "CalculatorEnvironment",
    "Environment",
    "EnvironmentFailure",
    "InteractiveRandomWalks",
    "Observation",
    "StepResult",
    "calculator",
    "call_maybe_async",
    "check_reset_result",
    "check_step_result",
    "encode_observation",
    "interactive_randomwalks",
    "load_environment_factory",
    "make_environment",
    "observation_problem",
]

"""Multi-turn environments and tools (docs/environments.md): pure Python, run in the reward
worker processes.

    env = lrl.envs.make("tools")                  # a registered environment
    driver = lrl.envs.Driver("tools", rows, tokenizer, pool=pool, max_turns=4)
"""
from lrl.envs import tool_env, tools
from lrl.envs.base import Environment, Step, get, make, names, register
from lrl.envs.driver import Driver, Trajectory
from lrl.envs.render import observation_ids
from lrl.envs.tool_env import ToolCall, ToolEnv, parse_tool_calls
from lrl.envs.tools import ToolError, tool

__all__ = ["Driver", "Environment", "Step", "ToolCall", "ToolEnv", "ToolError", "Trajectory",
           "get", "make", "names", "observation_ids", "parse_tool_calls", "register", "tool",
           "tool_env", "tools"]

"""A verifiers harness (harness id ``tether-chat``) that answers a task with one chat completion, made in the
episode's own process.

verifiers' own tool-less chat loop, the ``null`` harness, launches a PEP 723 script that ``uv`` installs
(openai, mcp, ...) from the network; this one needs nothing but the model. It keeps verifiers' contract for an
in-process harness (``vf.Harness.launch``): its one model call goes to the rollout's interception endpoint
with the rollout's secret, which records the turn on the trace and relays it to the model's endpoint
(tether's).
"""

from __future__ import annotations

import verifiers.v1 as vf
from openai import AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire


class TetherChatHarnessConfig(vf.HarnessConfig):
    pass


class TetherChatHarness(vf.Harness[TetherChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the task's system prompt as a system message
    SUPPORTS_RESUME = True  # a later turn is this call again on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx: vf.ModelContext, trace: vf.Trace, runtime: vf.Runtime, endpoint: str,
                     secret: str, mcp_urls: dict[str, str], data: vf.TaskData) -> vf.ProgramResult:
        system_prompt, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(exit_code=0, stdout=reply.choices[0].message.content or "", stderr="")


__all__ = ["TetherChatHarness"]

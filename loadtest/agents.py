"""Agents: a long system prompt and tool definitions shared by every agent, and tool turns.

Each task starts from the same long system prompt and tools (a prefix every replica can cache),
then loops: ask the model, append an assistant ``tool_calls`` message and the ``tool`` result,
ask again; after 2 to 4 tool steps the answer is final and a new task starts. Agents identify
themselves with the body's ``user`` field (kvgate's session key when no header is sent).
Run alone: ``locust -f loadtest/agents.py --host http://127.0.0.1:8000``.
"""

from __future__ import annotations

import json
import random
import uuid

from locust import between, task

from loadtest.common import KvgateUser
from loadtest.text import question, text_of

AGENT_SYSTEM = (
    "You are an autonomous operations agent. Use the tools to inspect and change the system; "
    "think step by step and call one tool at a time.\n\n# Runbook\n\n" + text_of("agent-runbook", 1500)
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {arg: {"type": "string", "description": f"the {arg}"} for arg in args},
                "required": list(args),
            },
        },
    }
    for name, desc, args in (
        ("search_docs", "Search the internal documentation.", ("query",)),
        ("read_file", "Read a file from the repository.", ("path",)),
        ("run_query", "Run a read-only metrics query.", ("promql", "range")),
        ("open_ticket", "Open a ticket for a human.", ("title", "body")),
    )
]


class AgentUser(KvgateUser):
    workload = "agent"
    weight = 2
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        super().on_start()
        self.rng = random.Random()
        self.new_task()

    def new_task(self) -> None:
        self.steps_left = self.rng.randint(2, 4)
        self.messages = [
            {"role": "system", "content": AGENT_SYSTEM},
            {"role": "user", "content": f"Task: {question(self.rng)}"},
        ]

    @task
    def step(self) -> None:
        reply = self.chat(self.messages, stream=True, tools=TOOLS, user=f"agent-{self.user_id}")
        if reply is None:
            self.new_task()
            return
        if self.steps_left <= 0:
            self.messages.append({"role": "assistant", "content": reply.text})
            self.new_task()
            return
        self.steps_left -= 1
        tool = self.rng.choice(TOOLS)["function"]
        call_id = "call_" + uuid.uuid4().hex[:16]
        args = {arg: question(self.rng) for arg in tool["parameters"]["required"]}
        self.messages.append({
            "role": "assistant", "content": None,
            "tool_calls": [{"id": call_id, "type": "function",
                            "function": {"name": tool["name"], "arguments": json.dumps(args)}}],
        })
        result = text_of(f"tool-{self.rng.random()}", self.rng.randint(40, 200))
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": result})

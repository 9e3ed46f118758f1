"""Multi-turn chat sessions: each user holds a conversation and resends it, growing, every turn.

The session is sticky through the ``x-session-id`` header (kvgate's session key); a session lasts
3 to 8 turns, then the user starts a new one. Every turn streams and records its TTFT.
Run alone: ``locust -f loadtest/chat.py --host http://127.0.0.1:8000``.
"""

from __future__ import annotations

import random
import uuid

from locust import between, task

from loadtest.common import KvgateUser
from loadtest.text import question, sentence

CHAT_SYSTEM = "You are a helpful assistant for an infrastructure team. Keep answers short."


class ChatUser(KvgateUser):
    workload = "chat"
    weight = 3
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        super().on_start()
        self.rng = random.Random()
        self.new_session()

    def new_session(self) -> None:
        self.session_id = uuid.uuid4().hex
        self.turns_left = self.rng.randint(3, 8)
        self.messages = [{"role": "system", "content": CHAT_SYSTEM}]

    @task
    def turn(self) -> None:
        ask = f"{sentence(self.rng)} {question(self.rng)}"
        self.messages.append({"role": "user", "content": ask})
        reply = self.chat(self.messages, stream=True, headers={"x-session-id": self.session_id})
        if reply is None:
            self.new_session()
            return
        self.messages.append({"role": "assistant", "content": reply.text})
        self.turns_left -= 1
        if self.turns_left <= 0:
            self.new_session()

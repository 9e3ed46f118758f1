"""kvgate's realistic traffic mix: chat sessions, tool-using agents and RAG (weights 3:2:2).

  locust -f loadtest/locustfile.py --host http://127.0.0.1:8000                 # web UI on :8089
  locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless \\
      -u 32 -r 8 -t 2m --csv results/run                # + results/run_cache.json/.csv

Each workload can also run alone: loadtest/chat.py, loadtest/agents.py, loadtest/rag.py.
Options: --model, --max-tokens, --api-key, --cache-report (see loadtest/common.py).
"""

from loadtest.agents import AgentUser
from loadtest.chat import ChatUser
from loadtest.rag import RagUser

__all__ = ["AgentUser", "ChatUser", "RagUser"]

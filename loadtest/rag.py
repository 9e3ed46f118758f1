"""RAG: a few long documents and many questions about them.

Every request is ``system + document + question``; the four documents are the same in every
locust process, and their popularity is skewed (8:4:2:1), so a cache-aware router keeps each
document's prefix hot on few replicas. Requests are not streamed (``usage`` is in the body).
Run alone: ``locust -f loadtest/rag.py --host http://127.0.0.1:8000``.
"""

from __future__ import annotations

import random

from locust import between, task

from loadtest.common import KvgateUser
from loadtest.text import question, text_of

RAG_SYSTEM = "Answer the question using only the document. Quote the sentence you rely on."
DOCUMENTS = [text_of(f"rag-document-{i}", 1200) for i in range(4)]
POPULARITY = [8, 4, 2, 1]


def rag_messages(doc_index: int, ask: str) -> list[dict]:
    doc = DOCUMENTS[doc_index]
    return [
        {"role": "system", "content": RAG_SYSTEM},
        {"role": "user", "content": f'<document id="{doc_index}">\n{doc}\n</document>\n\nQuestion: {ask}'},
    ]


class RagUser(KvgateUser):
    workload = "rag"
    weight = 2
    wait_time = between(0.05, 0.3)

    def on_start(self) -> None:
        super().on_start()
        self.rng = random.Random()

    @task
    def ask(self) -> None:
        doc = self.rng.choices(range(len(DOCUMENTS)), weights=POPULARITY)[0]
        self.chat(rag_messages(doc, question(self.rng)), stream=False)

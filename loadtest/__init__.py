"""Locust load tests for kvgate: realistic chat, agent and RAG traffic (see locustfile.py).

Runs in locust's own process: these modules import only the standard library and locust
(gevent's monkey-patching breaks the asyncio code in gateway/, so nothing from there is imported).
"""

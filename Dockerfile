# kvgate: the gateway (`kvgate serve`) and the simulated replicas (`kvgate sim`) in one image.
#   docker build -t kvgate:local .      docker run -p 8000:8000 -e KVGATE_REPLICAS=http://r:8000 kvgate:local
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /opt/kvgate
COPY pyproject.toml setup.py README.md ./
COPY policies ./policies
COPY gateway ./gateway
COPY worker_agent ./worker_agent
# A C compiler for the install only: setup.py compiles the request-path policy modules with mypyc
# (without one they install as plain Python, at about twice the routing cost).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install . \
    && apt-get purge -y --auto-remove gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin kvgate

USER kvgate
# Listen on every interface inside the container; compose and `docker run -p` publish the port.
ENV KVGATE_HOST=0.0.0.0 \
    KVGATE_PORT=8000
EXPOSE 8000

# /health answers on the gateway and on a simulated replica alike (compose sets finer checks).
HEALTHCHECK --interval=10s --timeout=4s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen('http://127.0.0.1:%s/health' % os.environ.get('KVGATE_PORT', '8000'), timeout=3)"]

CMD ["kvgate", "serve"]

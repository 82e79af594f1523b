# One image for every ACE service (web, workers, beat); docker-compose.yml picks the command.
FROM python:3.11-slim AS ace

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DJANGO_SETTINGS_MODULE=ace.settings \
    ACE_DATA_DIR=/var/lib/ace

WORKDIR /app
COPY requirements.txt .
RUN pip install --no-cache-dir -r requirements.txt

COPY . .
# /var/lib/ace/metrics: the compose file's shared `metrics` volume (prometheus_client multiprocess mode) takes this
# directory's owner when first created.
RUN useradd --system --create-home --home-dir /var/lib/ace ace && mkdir -p /var/lib/ace/metrics && chown -R ace /var/lib/ace
USER ace

EXPOSE 8000
CMD ["python", "-m", "uvicorn", "ace.asgi:application", "--host", "0.0.0.0", "--port", "8000"]

# The GPU worker image (docker-compose's worker-gpu-* services): the same ACE plus vLLM (PyPI's CUDA build) in its
# own virtual environment, which the managed-server supervisor runs for managed endpoints (ACE_VLLM_PYTHON).
# Build it with `--target gpu`; the other services use `--target ace` (no vLLM, no torch).
FROM ace AS gpu
USER root
RUN python -m venv /opt/vllm && /opt/vllm/bin/pip install --no-cache-dir vllm==0.32.0
ENV ACE_VLLM_PYTHON=/opt/vllm/bin/python
USER ace

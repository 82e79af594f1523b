# One image for every ACE service (web, workers, beat); docker-compose.yml picks the command.
FROM python:3.11-slim

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

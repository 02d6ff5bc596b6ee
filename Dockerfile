# The proxy alone; PostgreSQL runs in its own container (see docker-compose.yml).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY anonproxy ./anonproxy
COPY sql ./sql
RUN pip install --no-cache-dir . && useradd --system anonproxy
USER anonproxy
EXPOSE 6432
ENV ANONPROXY_LISTEN_HOST=0.0.0.0 ANONPROXY_LISTEN_PORT=6432
CMD ["anonproxy", "serve"]

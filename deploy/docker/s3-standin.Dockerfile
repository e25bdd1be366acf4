#
# The S3 endpoint of the CPU compose stack (compose.cpu.yaml): moto's S3 server, standing in for
# MinIO where no MinIO image can be had (no Docker Hub). It speaks S3 over HTTP to boto3 but checks
# no signatures and keeps objects in memory: for tests and demos, never for data you want to keep.
# The GPU deployment (compose.yaml alone) runs MinIO.
#
# Same base and the same offline wheelhouse as the omni-jobs image (see ../../Dockerfile).

ARG BASE=python:3.11-slim

FROM ${BASE} AS build
ARG PIP_OPTIONS=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY deploy/docker/wheels/ /wheels/
RUN python3 -m venv /opt/moto \
 && /opt/moto/bin/pip install $PIP_OPTIONS "moto[server]>=5,<6"

FROM ${BASE}
COPY --from=build /opt/moto /opt/moto
ENV PATH=/opt/moto/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
EXPOSE 9000
CMD ["moto_server", "-H", "0.0.0.0", "-p", "9000"]

# A stand-in for the official redis:7 image, from Debian's packages, for hosts that reach no
# image registry (compose/smoke.sh): `redis-server` in /data as user redis, redis-cli inside.
#   docker build -f compose/local-images/redis.Dockerfile \
#       --build-arg BASE_IMAGE=<a Debian image> -t splitmq-local/redis compose/local-images
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends redis-server redis-tools \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && mkdir -p /data && chown redis:redis /data
USER redis
# Without a config file Redis keeps its AOF and RDB files in its working directory.
WORKDIR /data
VOLUME /data
CMD ["redis-server"]

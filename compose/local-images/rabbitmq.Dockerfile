# A stand-in for the official rabbitmq:3-management image, from Debian's packages, for hosts
# that reach no image registry (compose/smoke.sh): the same data directory, conf.d layout,
# management plugin and RABBITMQ_DEFAULT_USER / RABBITMQ_DEFAULT_PASS variables.
#   docker build -f compose/local-images/rabbitmq.Dockerfile \
#       --build-arg BASE_IMAGE=<a Debian image> -t splitmq-local/rabbitmq compose/local-images
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
ARG DEBIAN_FRONTEND=noninteractive
# policy-rc.d: the package must not try to start the server while the image is built.
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
    && apt-get update \
    && apt-get install -y --no-install-recommends rabbitmq-server \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \
    && rabbitmq-plugins enable --offline rabbitmq_management \
    && mkdir -p /etc/rabbitmq/conf.d \
    && chown -R rabbitmq:rabbitmq /etc/rabbitmq /var/lib/rabbitmq /var/log/rabbitmq
COPY rabbitmq-entrypoint.sh /usr/local/bin/rabbitmq-entrypoint.sh
USER rabbitmq
ENV HOME=/var/lib/rabbitmq
VOLUME /var/lib/rabbitmq
ENTRYPOINT ["/usr/local/bin/rabbitmq-entrypoint.sh"]
CMD ["rabbitmq-server"]

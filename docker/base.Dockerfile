# The Python base tandem's images build FROM (the Dockerfile's PY_IMAGE), where it has to be made here.
# scripts/build-images.sh builds these targets; nothing else uses this file.
#   standin  where python:3.11-slim-bookworm cannot be pulled: Debian bookworm from debootstrap
#            (FROM_IMAGE, imported into Docker), Debian's Python 3.11 in a venv whose `python` and `pip`
#            come first on PATH, as the official image's do, and useradd for the images' user
#   trust    a base (FROM_IMAGE) that also trusts a CA bundle (ca-bundle.crt in the build context) in
#            pip: for builds behind a TLS-inspecting proxy. Every image built from it keeps the bundle.
ARG FROM_IMAGE

FROM ${FROM_IMAGE} AS standin
ARG DEBIAN_FRONTEND=noninteractive
# As Debian's -slim images: no documentation but copyrights, no manual pages or translations (the rootfs
# is imported without them). Versions are those of the Debian release debootstrap installed.
# hadolint ignore=DL3008
RUN printf 'path-exclude %s\n' '/usr/share/doc/*' '/usr/share/man/*' '/usr/share/info/*' '/usr/share/locale/*' \
      '/usr/share/lintian/*' > /etc/dpkg/dpkg.cfg.d/slim \
 && printf 'path-include %s\n' '/usr/share/doc/*/copyright' >> /etc/dpkg/dpkg.cfg.d/slim \
 && apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates passwd \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/python
ENV PATH=/opt/python/bin:$PATH LANG=C.UTF-8
CMD ["python3"]

FROM ${FROM_IMAGE} AS trust
COPY ca-bundle.crt /usr/local/share/tandem/ca-bundle.crt
ENV PIP_CERT=/usr/local/share/tandem/ca-bundle.crt

"""tandem's three service images for one target: what each runs and how its config reads."""

load("//tools/bazel:oci.bzl", "oci_image")

APP = "/opt/tandem/app"
PYTHON = "/opt/tandem/python"

SERVICES = {
    "router": struct(module = "router.server", port = "8000/tcp", engine = False),
    "prefill": struct(module = "prefill.server", port = "8100/tcp", engine = True),
    "decode": struct(module = "decode.server", port = "50051/tcp", engine = True),
}

# The services run as an unprivileged user with no passwd entry (none of the bases has one for
# it): HOME and USER say where caches go and who is running (torch and triton ask).
ENV = {
    "PYTHONPATH": APP + ":" + PYTHON,
    "PYTHONUNBUFFERED": "1",
    "HOME": "/tmp",
    "USER": "tandem",
    "LANG": "C.UTF-8",
}

def service_images(target, base, router_deps, engine_deps, suffix = "", base_name = "", env = {}, **kwargs):
    """<service>_<target><suffix> for router, prefill and decode.

    Layers: the base's, then the router's Python packages (all three), the engine's (prefill and
    decode), and the service's own code (//<service>:server's runfiles, :<service>_app).

    Args:
      target: "cpu", "cuda" or "rocm" (in names and labels).
      base: the base oci-archive.
      router_deps: layer of the router's Python packages.
      engine_deps: layer of the other Python packages of prefill and decode.
      suffix: appended to the target names.
      base_name: the base's reference, recorded in the manifest.
      env: environment added for this target.
      **kwargs: tags, testonly, visibility.
    """
    for service, s in SERVICES.items():
        layers = [router_deps] + ([engine_deps] if s.engine else []) + [":%s_app" % service]
        oci_image(
            name = "%s_%s%s" % (service, target, suffix),
            base = base,
            base_name = base_name,
            layers = layers,
            entrypoint = ["python3", "-m", s.module],
            env = dict(ENV, **env),
            user = "1000:1000",
            workdir = "/tmp",
            exposed_ports = [s.port],
            labels = {
                "org.opencontainers.image.title": "tandem-" + service,
                "org.opencontainers.image.description": "tandem %s (%s)" % (service, target),
                "dev.tandem.service": service,
                "dev.tandem.target": target,
            },
            **kwargs
        )

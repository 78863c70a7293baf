"""`runner images`: build, list and export the stack images the docker and podman engines run."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import typer
from rich.table import Table
from runner_contracts import write_atomic

from .._engines.apptainer import build_from_archive_command, build_from_definition_command, definition, run_build
from .._errors import UserError
from .._engines.images import (
    build_context,
    context_inputs,
    base_for,
    build_stack_image,
    connect,
    extra_ca_certificates,
    list_stack_images,
    save_docker_archive,
    stack_definition,
    stack_image,
)
from .._file_hashes import cached_sha256
from .._pins import record_image
from .._stacks import get_stack
from ._common import cli_errors, console, err_console, print_json

app = typer.Typer(help="Stack images for the docker and podman engines (and SIF files for Apptainer clusters).",
                  no_args_is_help=True)

ENGINE_HELP = "docker or podman (socket: DOCKER_HOST, or RUNNER_PODMAN_HOST / CONTAINER_HOST for podman)."


@app.command("build")
def build(
    stack: str = typer.Option(..., "--stack", help="Stack whose image to build (see `runner stacks list`)."),
    engine: str = typer.Option("docker", "--engine", help=ENGINE_HELP),
    flavour: str = typer.Option("cpu", "--base-flavour", help="cpu: a Debian base made here with debootstrap; "
                                                               "gpu: the pinned CUDA image (needs a registry)."),
    ca_cert: list[Path] = typer.Option(None, "--ca-cert", help="Extra CA certificate to trust inside the build "
                                                               "(repeatable; default: RUNNER_EXTRA_CA_CERTS, else "
                                                               "/usr/local/share/ca-certificates)."),
    json_output: bool = typer.Option(False, "--json", help="Print the image record as JSON."),
) -> None:
    """Build the stack's image unless one with the same content tag exists.

    The tag is a hash of the image definition, the lock, the base, local wheels, CA certificates and our
    sources, so an unchanged stack is never rebuilt and a changed lock always is. The digest is added to
    the stack's pin record (stacks/<stack>/pins.json).
    """
    with cli_errors():
        manifest = get_stack(stack)
        if flavour == "gpu":
            manifest = manifest.for_gpu()  # a stack with a GPU lock builds its GPU image from it
        client = connect(engine)
        with err_console.status(f"building the {stack} image"):
            image = build_stack_image(client, manifest, flavour=flavour, certs=ca_cert or None,
                                      log=lambda message: err_console.print(f"[dim]{message}[/]"))
        record_image(manifest, engine, image.tag, image.digest, image.lock_sha256)
    data = {"stack": image.stack, "tag": image.tag, "digest": image.digest, "python": image.python,
            "lock_sha256": image.lock_sha256, "engine": engine}
    if json_output:
        print_json(data)
    else:
        console.print(f"{image.tag}  {image.digest}", highlight=False)


@app.command("list")
def list_images(
    engine: str = typer.Option("docker", "--engine", help=ENGINE_HELP),
    json_output: bool = typer.Option(False, "--json", help="Print the images as JSON."),
) -> None:
    """Stack images the engine holds, with their pins (from the image labels)."""
    with cli_errors():
        rows = list_stack_images(connect(engine))
    if json_output:
        print_json(rows)
        return
    table = Table(title=f"stack images ({engine})")
    for column in ("stack", "tag", "digest", "upstream", "lock", "MB"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["stack"], row["tag"], row["digest"][:19], row["upstream"], row["lock_sha256"][:12],
                      str(row["size_mb"]))
    console.print(table)


@app.command("export")
def export(
    stack: str = typer.Option(..., "--stack", help="Stack whose image to export."),
    to: str = typer.Option(..., "--to", help="sif (Apptainer image, via a docker-archive), docker-archive "
                                             "(`docker save` tar) or def (Apptainer definition + build context)."),
    out: Path = typer.Option(Path("images/out"), "--out", help="Folder for the exported files."),
    engine: str = typer.Option("docker", "--engine", help=ENGINE_HELP),
    image: str = typer.Option(None, "--image", help="Image to export (default: the stack's current image)."),
    apptainer: str = typer.Option("apptainer", "--apptainer", help="Apptainer binary name (apptainer or singularity)."),
    mksquashfs_args: str = typer.Option(None, "--mksquashfs-args", help="Passed to `apptainer build`: '-comp lz4' "
                                        "builds a SIF in about half the time, ~40% larger than the default gzip (a SIF of an "
                                        "unchanged image is kept: remove it to build it again with other arguments)."),
) -> None:
    """Export a stack image for clusters: a docker-archive, a SIF built from it, or a .def.

    Without an Apptainer binary here, `--to sif` writes the archive and prints the build line to run
    on a machine that has one (exit 2).
    """
    with cli_errors():
        if to not in ("sif", "docker-archive", "def"):
            raise UserError(f"--to {to!r}: expected sif, docker-archive or def")
        manifest = get_stack(stack)
        if to == "def":
            manifest = manifest.for_gpu()  # the .def bootstraps from the CUDA base: the GPU lock where there is one
            name = manifest.image_name
            base = base_for(manifest, "gpu")
            inputs = context_inputs(manifest, base.tag, extra_ca_certificates(None), "gpu")
            target = out / f"{name}-def"
            if target.exists():
                raise UserError(f"{target} exists; remove it or choose another --out")
            with build_context(manifest, inputs) as context:
                shutil.copytree(context, target)
            (target / f"{name}.def").write_text(definition(
                manifest, stack_definition(manifest), inputs["buildargs"], base_containerfile=base.definition,
                base_args={"CUDA_IMAGE": base.image or "", "PYTHON": base.python}, context=target))
            console.print(f"wrote {target / (name + '.def')} and its build context; on the cluster:\n  "
                          + shlex.join(build_from_definition_command(Path(f"{name}.sif"), Path(f"{name}.def"),
                                                                     apptainer)), highlight=False)
            return
        client = connect(engine)
        if image is None:
            image = build_stack_image(client, manifest, log=lambda message: err_console.print(f"[dim]{message}[/]")).tag
        record = stack_image(client, image)
        sif = out / f"{manifest.image_name}.sif"  # the name the apptainer engine runs (RUNNER_SIF_DIR=out)
        built_from = sif.with_name(sif.name + ".image")  # the digest of the image the SIF was built from
        if to == "sif" and sif.is_file() and built_from.is_file() and built_from.read_text() == record.digest:
            digest = "sha256:" + cached_sha256(sif)
            record_image(manifest, "apptainer", f"{record.tag}.sif", digest, record.lock_sha256)
            console.print(f"sif: {sif} ({digest}; built from {record.tag}, unchanged)", highlight=False)
            return
        archive = save_docker_archive(client, record.tag, out / f"{record.tag.replace(':', '-')}.tar")
        console.print(f"docker-archive: {archive}", highlight=False)
        if to == "sif":
            built_from.unlink(missing_ok=True)
            run_build(build_from_archive_command(sif, archive, apptainer, mksquashfs_args))
            write_atomic(built_from, record.digest.encode())
            archive.unlink()  # the SIF holds the same bytes; the archive is as large again
            digest = "sha256:" + cached_sha256(sif)
            record_image(manifest, "apptainer", f"{record.tag}.sif", digest, record.lock_sha256)
            console.print(f"sif: {sif} ({digest})", highlight=False)

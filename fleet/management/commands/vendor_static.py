"""Copy third-party browser assets from installed Python packages into static/vendor/ (no CDN at run time).

    python manage.py vendor_static           # copy (overwrites) plotly's bundled plotly.min.js
    python manage.py vendor_static --check   # exit 1 when the committed copy differs from the installed one

static/vendor/plotly.min.js is committed, so a fresh clone works without running this; run it after
upgrading the `plotly` pin in requirements.txt.
"""

from __future__ import annotations

import filecmp
import shutil
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser


def vendored_assets() -> dict[Path, Path]:
    """Destination under static/vendor -> the file shipped inside an installed package."""
    import plotly

    plotly_js = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    return {settings.BASE_DIR / "static" / "vendor" / "plotly.min.js": plotly_js}


class Command(BaseCommand):
    help = "Copy plotly's bundled JS (and other vendored assets) into static/vendor/."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--check", action="store_true", help="Only compare; fail when a copy is stale.")

    def handle(self, *args, check: bool, **options) -> None:
        stale = []
        for dest, src in vendored_assets().items():
            if not src.is_file():
                raise CommandError(f"{src} is missing: is the package installed?")
            if dest.is_file() and filecmp.cmp(src, dest, shallow=False):
                self.stdout.write(f"up to date: {dest.relative_to(settings.BASE_DIR)}")
                continue
            if check:
                stale.append(str(dest.relative_to(settings.BASE_DIR)))
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest)
            self.stdout.write(f"copied {src} -> {dest.relative_to(settings.BASE_DIR)}")
        if stale:
            raise CommandError(f"stale vendored assets (run manage.py vendor_static): {', '.join(stale)}")

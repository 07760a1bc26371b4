"""vsekit: visual-semantic embedding toolkit (VSE++, VSE∞/GPO, VSE+2AD, ladder loss, AVSE)."""

__version__ = "0.1.0"

from . import functional as functional

"""Import every built-in module that registers components."""

from . import data, models  # noqa: F401
from .tasks import classification  # noqa: F401
from .recipe import aggregators, server_opt, sharing, weighting  # noqa: F401
from .recipe import robust  # noqa: F401
from .recipe import norm_sharing  # noqa: F401
from .recipe import feddyn, scaffold  # noqa: F401
from .recipe import elastic, fednova, fedprox  # noqa: F401
from .recipe import fedvg  # noqa: F401
from .data import video  # noqa: F401
from .models import vsr  # noqa: F401
from .tasks import video_sr  # noqa: F401
from .recipe import fedvsr  # noqa: F401
from .recipe import local_adam  # noqa: F401
from .recipe import fed3r, oll  # noqa: F401
from .recipe import personalize  # noqa: F401

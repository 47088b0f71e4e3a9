"""FedSight on Flower (``flwr`` 1.41): the same recipes as a Flower ServerApp/ClientApp.

* ``records``: ClientResult / round instruction <-> Flower ``RecordDict`` (bit-exact);
* ``client_app`` / ``server_app``: the adapter (``app`` objects and ``make_*_app(settings)``);
* ``node``: a SuperNode's data (its partition, or its own ``data-dir``) and on-disk client state;
* ``app``: write a runnable Flower app directory for a FedSight config;
* ``simulation``: Flower's Ray-backed simulation engine as a FedSight engine option;
* ``local``: a loopback deployment (SuperLink + N SuperNodes) driven end to end;
* ``dp``: central DP through Flower's DP strategy wrapper; ``tls``: certificates and node keys;
* ``run_config``: the FedSight config as Flower run-config keys (``fedsight.server.rounds``) and back;
* ``cli``: ``fedsight flower ...`` commands.

Requires the ``flower`` extra, installed from a FedSight clone (FedSight is not on PyPI): ``INSTALL``.
"""

#: the install of FedSight with Flower, run in a clone of FedSight (the README's install, with the extra)
INSTALL = 'pip install -c constraints.txt -e ".[flower]"'

